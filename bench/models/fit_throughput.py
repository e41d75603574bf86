"""Fit the throughput model (policies/search/throughput.py) to measured steps, and write its coefficients.

    python -m bench.models.fit_throughput [bench/results/throughput-h200-2026-12-01] [--write]
    python -m bench.models.fit_throughput --provisional --write  # the issue's numbers, until the sweep lands

Reads every ``sweep.jsonl`` under the given directories (``bench/models/throughput_sweep.py`` writes one
record per shape and per config), fits by least squares:

1. per optimizer kind, seconds per adapter parameter of the optimizer step (``optimizer_s``,
   through the origin: the step is a loop over the adapter's tensors);
2. per checkpointing mode, ``seconds per micro-step - optimizer step = a x 4-bit weight bytes +
   b x tokens x work per token`` (two coefficients, no intercept: a micro-step of no weights and
   no tokens costs nothing);
3. the bf16 head's factor on the per-token part, from the issue's 8B measurement (the upcast
   3132 tokens/s against 4490 with the embeddings and head left in bf16), until a parity sweep
   measures it on more shapes;

prints predicted against measured tokens/s for every config with the error, and with ``--write``
writes ``policies/search/throughput_fit.py`` (constants, with the fit's provenance in its docstring).
Constants in a module rather than a JSON data file: the policy needs no file I/O (the package
stays pure), mypy sees the types, and the wheel needs no package-data entry to carry them.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import sys
import textwrap
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.policies.search import throughput
from qlora_supervise.trainer_child.contract.spec import Knobs

ROOT = Path(__file__).resolve().parents[2]
FIT_MODULE = ROOT / "policies" / "search" / "throughput_fit.py"
DEFAULT_SWEEP = ROOT / "bench" / "results" / "throughput-h200-2026-12-01"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")

SHAPE_7B = ModelShape(hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008, vocab=32000)
SHAPE_8B = ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
#: Priors for the optimizer step where the sweep did not measure it (seconds per adapter parameter):
#: a foreach AdamW over 16.8M bf16 parameters takes ~20 ms on an H200; the paged 8-bit step
#: measured 8 ms slower per step than adamw_torch in the rung-cost set (10470.7 -> 10416.0 tokens/s
#: at 16384 tokens per step).
OPTIMIZER_PRIOR = {"adamw_torch": 1.2e-9, "adamw_torch_fused": 1.0e-9, "paged_adamw_8bit": 1.7e-9}
#: The issue's measurement of the bf16 head (8B 128k, seq 2048, micro 1, checkpointing, r 8 on
#: q/k/v/o, paged 8-bit): tokens/s with the upcast head, and with the head left in bf16.
HEAD_POINT = (
    Knobs(model="8b-128k", micro_batch_size=1, grad_accum=1, max_seq_len=2048, lora_r=8),
    3132.0,
    4490.0,
)


@dataclass(frozen=True)
class Point:
    """One measured config: its shape and knobs, tokens/s, and the optimizer step if measured."""

    label: str
    shape: ModelShape
    knobs: Knobs
    tokens_per_s: float
    optimizer_s: float | None = None
    peak_bytes: int | None = None  # measured max_allocated (the sweep's)


def provisional_points() -> list[Point]:
    """The numbers the issue and the rung-cost set give (7B, seq 2048, r 16 on q/k/v/o, adamw_torch)."""
    rows = [  # (micro, accumulation, checkpointing, tokens/s, where it was measured)
        (1, 16, False, 6900.0, "issue 19: pre-flight's choice"),
        (8, 2, True, 7760.0, "issue 19"),
        (4, 4, True, 7580.0, "issue 19"),
        (4, 2, False, 10470.7, "rungs-table baseline"),
        (4, 2, True, 7743.2, "rungs-table checkpointing"),
        (2, 4, False, 9811.8, "rungs-table halve micro-batch"),
    ]
    points = []
    for micro, accum, ckpt, rate, where in rows:
        knobs = Knobs(
            model="7b-32k",
            micro_batch_size=micro,
            grad_accum=accum,
            max_seq_len=2048,
            gradient_checkpointing=ckpt,
            optimizer="adamw_torch",
            lora_r=16,
        )
        points.append(
            Point(
                f"7b s2048 b{micro}x{accum} {'ckpt' if ckpt else 'no-ckpt'} ({where})", SHAPE_7B, knobs, rate
            )
        )
    return points


def sweep_points(directories: Iterable[Path]) -> list[Point]:
    """Every config the sweeps measured ``ok``, at accumulation 1 (one step = one micro-step)."""
    points = []
    for directory in directories:
        for path in sorted(directory.rglob("sweep*.jsonl")):
            shapes: dict[str, ModelShape] = {}
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    raw = json.loads(line)
                except ValueError:
                    continue
                if raw.get("kind") == "shape":
                    shape = ModelShape.from_config(raw["config"])
                    if shape is not None:
                        shapes[raw["shape"]] = shape
                elif raw.get("kind") == "config" and raw.get("status") == "ok" and raw["shape"] in shapes:
                    points.append(_sweep_point(raw, shapes[raw["shape"]]))
    return points


def _sweep_point(raw: dict[str, Any], shape: ModelShape) -> Point:
    knobs = Knobs(
        model=raw["shape"],
        micro_batch_size=raw["micro"],
        grad_accum=1,
        max_seq_len=raw["seq"],
        gradient_checkpointing=raw["checkpointing"],
        optimizer=raw["optimizer"],
        lora_r=raw["r"],
    )
    ckpt = "ckpt" if raw["checkpointing"] else "no-ckpt"
    label = f"{raw['shape']} s{raw['seq']} b{raw['micro']} {ckpt} {raw['optimizer']}"
    return Point(
        label, shape, knobs, float(raw["tokens_per_s"]), raw.get("optimizer_s"), raw.get("max_allocated")
    )


def fit_optimizer(points: list[Point]) -> dict[str, float]:
    """Seconds per adapter parameter per optimizer kind: least squares through the origin."""
    out = dict(OPTIMIZER_PRIOR)
    for kind in {p.knobs.optimizer for p in points if p.optimizer_s is not None}:
        measured = [p for p in points if p.knobs.optimizer == kind and p.optimizer_s is not None]
        xs = np.array([throughput.adapter_params(p.shape, p.knobs, TARGETS) for p in measured], dtype=float)
        ys = np.array([p.optimizer_s for p in measured], dtype=float)
        out[kind] = float(xs @ ys / (xs @ xs))
    return out


def micro_seconds(p: Point, optimizer: dict[str, float]) -> float:
    """The measured micro-step (forward + backward) of ``p``: its step time less the optimizer step."""
    tokens = p.knobs.micro_batch_size * p.knobs.grad_accum * p.knobs.max_seq_len
    per_param = optimizer.get(p.knobs.optimizer, optimizer["adamw_torch"])
    opt = per_param * throughput.adapter_params(p.shape, p.knobs, TARGETS)
    return (tokens / p.tokens_per_s - opt) / p.knobs.grad_accum


#: The terms of a micro-step, in the order of the fitted coefficients.
TERMS = ("launch_s_per_layer", "fixed_s_per_byte", "token_s", "head_token_s")


def features(p: Point) -> list[float]:
    tokens = p.knobs.micro_batch_size * p.knobs.max_seq_len
    return [
        float(p.shape.layers),
        float(throughput.weight_bytes(p.shape, p.knobs)),
        float(tokens * throughput.work_per_token(p.shape, p.knobs.max_seq_len)),
        float(tokens * throughput.head_work_per_token(p.shape)),
    ]


def fit_mode(points: list[Point], optimizer: dict[str, float]) -> dict[str, float]:
    """The coefficients of one checkpointing mode (:data:`TERMS`): least squares on the *relative* error (each
    row divided by its time, so a 0.1 s micro-step counts as much as a 4 s one), non-negative (of
    every subset of the terms, the best fit whose coefficients are all >= 0: a term the data cannot
    tell apart from another, such as launches and bytes with one shape, is dropped, not negative)."""
    x = np.array([features(p) for p in points])
    y = np.array([micro_seconds(p, optimizer) for p in points])
    scale = x.max(axis=0)  # columns of ~1e1, ~1e9 and ~1e13: solved at one scale
    rows = (x / scale) / y[:, None]
    best: tuple[float, np.ndarray] | None = None
    terms = len(TERMS)
    subsets = itertools.chain.from_iterable(
        itertools.combinations(range(terms), n) for n in range(terms, 0, -1)
    )
    for subset in subsets:
        cols = list(subset)
        solution, *_ = np.linalg.lstsq(rows[:, cols], np.ones(len(y)), rcond=None)
        if (solution < 0).any():
            continue
        residual = float(np.sum((rows[:, cols] @ solution - 1) ** 2))
        if best is None or residual < best[0] - 1e-12:
            full = np.zeros(terms)
            full[cols] = solution
            best = (residual, full)
    assert best is not None  # one term alone through the origin of positive data is positive
    return dict(zip(TERMS, (best[1] / scale).tolist(), strict=True))


def fit(points: list[Point], head: float = 1.0) -> throughput.Coefficients:
    optimizer = fit_optimizer(points)
    modes = {
        mode: fit_mode([p for p in points if p.knobs.gradient_checkpointing is ckpt], optimizer)
        for mode, ckpt in (("no_ckpt", False), ("ckpt", True))
    }
    c = throughput.Coefficients(
        {mode: terms["launch_s_per_layer"] for mode, terms in modes.items()},
        {mode: terms["fixed_s_per_byte"] for mode, terms in modes.items()},
        {mode: terms["token_s"] for mode, terms in modes.items()},
        {mode: terms["head_token_s"] for mode, terms in modes.items()},
        optimizer,
    )
    return dataclasses.replace(c, bf16_head_token_factor=head)


def head_factors(c: throughput.Coefficients, directories: Iterable[Path]) -> list[tuple[str, float]]:
    """The per-token part's factor with the bf16 head, per measurement: the issue's point
    (:data:`HEAD_POINT`) and every upcast/bf16 pair of a ``parity.jsonl`` (bench/models/head_parity.py)."""
    knobs, upcast, bf16 = HEAD_POINT
    pairs = [("issue 19 (8B 128k, micro 1, ckpt)", knobs, upcast, bf16)]
    for directory in directories:
        for path in sorted(directory.rglob("parity.jsonl")):
            runs = [
                json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()
            ]
            ok = {r["name"]: r for r in runs if r.get("kind") == "run" and r.get("status") == "ok"}
            if "upcast" in ok and "bf16" in ok:
                u, h = ok["upcast"], ok["bf16"]
                parity = Knobs(
                    model="8b-128k",
                    micro_batch_size=u["micro"],
                    grad_accum=1,
                    max_seq_len=u["seq"],
                    gradient_checkpointing=u["checkpointing"],
                    optimizer=u["optimizer"],
                    lora_r=u["r"],
                )
                pairs.append(
                    (str(path.parent.name) + "/parity.jsonl", parity, u["tokens_per_s"], h["tokens_per_s"])
                )
    out = []
    for label, k, slow, fast in pairs:
        tokens = k.micro_batch_size * k.max_seq_len
        mode = "ckpt" if k.gradient_checkpointing else "no_ckpt"
        fixed = c.launch_s_per_layer[mode] * SHAPE_8B.layers + c.fixed_s_per_byte[
            mode
        ] * throughput.weight_bytes(SHAPE_8B, k)
        fixed += throughput.optimizer_seconds(SHAPE_8B, k, TARGETS, c)
        out.append((label, max(0.1, (tokens / fast - fixed) / (tokens / slow - fixed))))
    return out


def head_factor(factors: list[tuple[str, float]]) -> tuple[float, str]:
    """One factor from the measurements, and why: their median when they agree on the direction,
    else 1.0 (no speed claimed either way until they do)."""
    values = [f for _, f in factors]
    text = "; ".join(f"{label}: {f:.2f}" for label, f in factors)
    if all(f < 1 for f in values) or all(f > 1 for f in values):
        return min(1.5, float(np.median(values))), f"bf16 head factor, the median of: {text}."
    return 1.0, f"bf16 head factor 1.0 (no speed claimed): the measurements disagree ({text})."


def render_module(
    result: throughput.Coefficients,
    sources: list[str],
    points: list[Point],
    provisional: bool,
    head_note: str,
) -> str:
    errors = [abs(e) for e in prediction_errors(points, result)]
    recompute = result.token_s["ckpt"] / result.token_s["no_ckpt"] - 1 if result.token_s["no_ckpt"] else 0.0
    about = [
        ("PROVISIONAL: c" if provisional else "C")
        + "oefficients of the throughput model (search/throughput.py), written by "
        + "bench/models/fit_throughput.py.",
        f"Fitted {datetime.date.today().isoformat()} on {len(points)} configs from: {'; '.join(sources)}.",
        f"Error of tokens/s on those configs: median {100 * float(np.median(errors)):.1f} %, "
        f"worst {100 * max(errors):.1f} %.",
        f"Recompute share with checkpointing (token cost on / off - 1): {recompute:.2f}.",
        head_note,
    ]
    picked = choices(points, result)[-1]
    if picked.startswith("share of the fastest"):
        about.append(
            f"Choosing among the configs measured to fit a cap of {', '.join(map(str, CHOICE_CAPS))} GiB, "
            f"the model's pick has this {picked} (bench/models/fit_throughput.py prints the table)."
        )
    if not any(result.fixed_s_per_byte.values()):
        about.append(
            "The fit keeps no cost per weight byte: with the 1B beside the 7B and 8B, the fixed part of a "
            "micro-step follows the layer count (kernel launches), not the bytes dequantized."
        )
    if provisional:
        about.append(PROVISIONAL_NOTE)
    about.append(
        "Do not edit by hand: run ``python -m bench.models.fit_throughput --write`` on the sweep instead."
    )
    docstring = "\n\n".join(textwrap.fill(paragraph, 100, break_on_hyphens=False) for paragraph in about)
    return f'''"""{docstring}
"""

from __future__ import annotations

from collections.abc import Mapping

PROVISIONAL = {provisional}
#: Seconds per micro-step per decoder layer (kernel launches), by checkpointing mode.
LAUNCH_S_PER_LAYER: Mapping[str, float] = {_mapping(result.launch_s_per_layer)}
#: Seconds per micro-step per byte of 4-bit weights (dequantization), by checkpointing mode.
FIXED_S_PER_BYTE: Mapping[str, float] = {_mapping(result.fixed_s_per_byte)}
#: Seconds per token per multiply-add of the decoder blocks' forward, by checkpointing mode.
TOKEN_S: Mapping[str, float] = {_mapping(result.token_s)}
#: Seconds per token per multiply-add of the LM head (and its loss), by checkpointing mode.
HEAD_TOKEN_S: Mapping[str, float] = {_mapping(result.head_token_s)}
#: Seconds of the optimizer step per adapter parameter, by optimizer kind.
OPTIMIZER_S_PER_PARAM: Mapping[str, float] = {_mapping(result.optimizer_s_per_param)}
#: The per-token part's factor with the embeddings and LM head left in bf16 (bf16_head).
BF16_HEAD_TOKEN_FACTOR = {result.bf16_head_token_factor:.4f}
'''


PROVISIONAL_NOTE = (
    "One shape only (7B, seq 2048): the fixed and the per-token parts of other shapes are "
    "extrapolated; refit on bench/results/throughput-h200-2026-12-01 (three shapes) when it lands."
)


def _mapping(values: Mapping[str, float]) -> str:
    # Six significant digits, spelled as Python (and ruff's formatter) spells a float.
    rows = "".join(f'    "{k}": {float(f"{v:.6e}")!r},\n' for k, v in sorted(values.items()))
    return "{\n" + rows + "}"


def prediction_errors(points: list[Point], result: throughput.Coefficients) -> list[float]:
    return [predicted(p, result) / p.tokens_per_s - 1 for p in points]


def predicted(p: Point, result: throughput.Coefficients) -> float:
    return throughput.predict(p.shape, p.knobs, TARGETS, result).tokens_per_s


def table(points: list[Point], result: throughput.Coefficients) -> list[str]:
    lines = [f"{'config':<62} {'measured':>9} {'predicted':>9} {'error':>7}"]
    for p, error in zip(points, prediction_errors(points, result), strict=True):
        lines.append(
            f"{p.label[:62]:<62} {p.tokens_per_s:>9.0f} {predicted(p, result):>9.0f} {100 * error:>+6.1f}%"
        )
    errors = [abs(e) for e in prediction_errors(points, result)]
    lines.append(f"median |error| {100 * float(np.median(errors)):.1f} %, worst {100 * max(errors):.1f} %")
    return lines


#: Caps the choice table tries (GiB): does the model pick, among the configs measured to fit, the fastest?
CHOICE_CAPS = (8, 12, 16, 24, 40, 80)


def choice_shares(points: list[Point], result: throughput.Coefficients) -> list[tuple[str, float]]:
    """Per shape, seq_len, optimizer and cap: (a table row, the measured tokens/s of the model's pick
    among the configs whose measured peak fits, as a share of the measured fastest). A config
    measured twice (the sweep and its repeat) counts with the mean of its measurements."""
    configs: dict[Knobs, list[Point]] = {}
    for p in points:
        if p.peak_bytes is not None and p.knobs.grad_accum == 1:
            configs.setdefault(p.knobs, []).append(p)
    groups: dict[tuple[str, int, str], list[tuple[Point, float, int]]] = {}
    for knobs, measured in configs.items():
        rate = float(np.mean([p.tokens_per_s for p in measured]))
        peak = max(p.peak_bytes or 0 for p in measured)
        groups.setdefault((knobs.model, knobs.max_seq_len, knobs.optimizer), []).append(
            (measured[0], rate, peak)
        )
    out = []
    for (shape, seq, optimizer), group in sorted(groups.items()):
        for cap in CHOICE_CAPS:
            fitting = [(p, rate) for p, rate, peak in group if peak <= cap << 30]
            if len(fitting) < 2:
                continue
            pick = max(fitting, key=lambda c: predicted(c[0], result))
            best = max(fitting, key=lambda c: c[1])
            row = f"{shape:<8} {seq:>5} {optimizer:<17} {cap:>4}  {_short(pick[0]):<12} {_short(best[0]):<12}"
            out.append((row, pick[1] / best[1]))
    return out


def choices(points: list[Point], result: throughput.Coefficients) -> list[str]:
    """:func:`choice_shares` as a table, its summary last (the issue's target: >= 95 % of the fastest)."""
    rows = choice_shares(points, result)
    lines = [
        f"{'shape':<8} {'seq':>5} {'optimizer':<17} {'cap':>4}  {'model picks':<12} {'fastest':<12} share"
    ]
    lines += [f"{row} {100 * share:.0f} %" for row, share in rows]
    if rows:
        shares = [share for _, share in rows]
        worst, median = min(shares), float(np.median(shares))
        good = sum(s >= 0.95 for s in shares)
        lines.append(f"share of the fastest: median {100 * median:.0f} %, worst {100 * worst:.0f} %, "
                     f"{good} of {len(shares)} at >= 95 %")  # fmt: skip
    return lines


def _short(p: Point) -> str:
    return f"b{p.knobs.micro_batch_size} {'ckpt' if p.knobs.gradient_checkpointing else 'no-ckpt'}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sweeps", nargs="*", type=Path, default=[DEFAULT_SWEEP])
    parser.add_argument("--provisional", action="store_true", help="fit the issue's numbers, not a sweep")
    parser.add_argument("--write", action="store_true", help=f"write {FIT_MODULE.relative_to(ROOT)}")
    args = parser.parse_args(argv)
    if args.provisional:
        points, sources = (
            provisional_points(),
            ["issue 19's 7B numbers and rungs-table.txt (memory-grid-h200-2026-12-01)"],
        )
    else:
        points = sweep_points(args.sweeps)
        sources = [
            str(d.relative_to(ROOT) if d.is_absolute() and d.is_relative_to(ROOT) else d) for d in args.sweeps
        ]
    if len(points) < 2:
        print(f"no measured configs under {', '.join(map(str, args.sweeps))}", file=sys.stderr)
        return 1
    plain = fit(points)
    head, head_note = head_factor(head_factors(plain, [] if args.provisional else args.sweeps))
    result = dataclasses.replace(plain, bf16_head_token_factor=head)
    print("\n".join(table(points, result)))
    for term in (*TERMS, "optimizer_s_per_param"):
        print(f"{term}: {getattr(result, term)}")
    print(head_note)
    print("\n".join(choices(points, result)))
    if args.write:
        module = render_module(result, sources, points, args.provisional, head_note)
        FIT_MODULE.write_text(module, encoding="utf-8")
        print(f"wrote {FIT_MODULE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
