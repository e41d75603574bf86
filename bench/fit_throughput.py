"""Fit the throughput model (policies/throughput.py) to measured steps, and write its coefficients.

    python bench/fit_throughput.py [bench/results/throughput-h200-2026-12-01] [--write]
    python bench/fit_throughput.py --provisional --write     # the issue's numbers, until the sweep lands

Reads every ``sweep.jsonl`` under the given directories (``bench/throughput_sweep.py`` writes one
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
writes ``policies/throughput_fit.py`` (constants, with the fit's provenance in its docstring).
Constants in a module rather than a JSON data file: the policy needs no file I/O (the package
stays pure), mypy sees the types, and the wheel needs no package-data entry to carry them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import textwrap
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qlora_supervise.policies import throughput
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.trainer_child.contract.spec import Knobs

ROOT = Path(__file__).resolve().parent.parent
FIT_MODULE = ROOT / "policies" / "throughput_fit.py"
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
        for path in sorted(directory.rglob("sweep.jsonl")):
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
    return Point(label, shape, knobs, float(raw["tokens_per_s"]), raw.get("optimizer_s"))


@dataclass(frozen=True)
class Fit:
    fixed_s_per_byte: dict[str, float]
    token_s: dict[str, float]
    optimizer_s_per_param: dict[str, float]
    bf16_head_token_factor: float


def fit_optimizer(points: list[Point]) -> dict[str, float]:
    """Seconds per adapter parameter per optimizer kind: least squares through the origin."""
    out = dict(OPTIMIZER_PRIOR)
    kinds = {p.knobs.optimizer for p in points if p.optimizer_s is not None}
    for kind in kinds:
        xs = np.array(
            [
                throughput.adapter_params(p.shape, p.knobs, TARGETS)
                for p in points
                if p.knobs.optimizer == kind and p.optimizer_s is not None
            ],
            dtype=float,
        )
        ys = np.array(
            [p.optimizer_s for p in points if p.knobs.optimizer == kind and p.optimizer_s is not None]
        )
        out[kind] = float(xs @ ys / (xs @ xs))
    return out


def micro_seconds(p: Point, optimizer: dict[str, float]) -> float:
    """The measured micro-step (forward + backward) of ``p``: its step time less the optimizer step."""
    tokens = p.knobs.micro_batch_size * p.knobs.grad_accum * p.knobs.max_seq_len
    per_param = optimizer.get(p.knobs.optimizer, optimizer["adamw_torch"])
    opt = per_param * throughput.adapter_params(p.shape, p.knobs, TARGETS)
    return (tokens / p.tokens_per_s - opt) / p.knobs.grad_accum


def fit_mode(points: list[Point], optimizer: dict[str, float]) -> tuple[float, float]:
    """(seconds per weight byte, seconds per token x work) for one checkpointing mode."""
    features = np.array(
        [
            [
                throughput.weight_bytes(p.shape, p.knobs),
                p.knobs.micro_batch_size
                * p.knobs.max_seq_len
                * throughput.work_per_token(p.shape, p.knobs.max_seq_len),
            ]
            for p in points
        ],
        dtype=float,
    )
    ys = np.array([micro_seconds(p, optimizer) for p in points])
    # Scale the columns to one before solving: bytes are ~1e9 and token work ~1e13.
    norms = features.max(axis=0)
    solution, *_ = np.linalg.lstsq(features / norms, ys, rcond=None)
    a, b = (solution / norms).tolist()
    if a < 0 or b <= 0:  # too few shapes to tell the two apart: all of it per token
        a, b = 0.0, float(ys @ features[:, 1] / (features[:, 1] @ features[:, 1]))
    return a, b


def fit(points: list[Point]) -> Fit:
    optimizer = fit_optimizer(points)
    fixed, token = {}, {}
    for mode, ckpt in (("no_ckpt", False), ("ckpt", True)):
        a, b = fit_mode([p for p in points if p.knobs.gradient_checkpointing is ckpt], optimizer)
        fixed[mode], token[mode] = a, b
    return Fit(fixed, token, optimizer, head_factor(fixed, token, optimizer))


def head_factor(fixed: dict[str, float], token: dict[str, float], optimizer: dict[str, float]) -> float:
    """The per-token part's factor with the bf16 head, from :data:`HEAD_POINT` (fixed part as fitted)."""
    knobs, upcast, bf16 = HEAD_POINT
    tokens = knobs.micro_batch_size * knobs.max_seq_len
    base = fixed["ckpt"] * throughput.weight_bytes(SHAPE_8B, knobs)
    base += optimizer["paged_adamw_8bit"] * throughput.adapter_params(SHAPE_8B, knobs, TARGETS)
    return max(0.1, min(1.0, (tokens / bf16 - base) / (tokens / upcast - base)))


def render_module(result: Fit, sources: list[str], points: list[Point], provisional: bool) -> str:
    errors = [abs(e) for e in prediction_errors(points, result)]
    recompute = result.token_s["ckpt"] / result.token_s["no_ckpt"] - 1
    about = [
        ("PROVISIONAL: c" if provisional else "C")
        + "oefficients of the throughput model (policies/throughput.py), written by bench/fit_throughput.py.",
        f"Fitted {datetime.date.today().isoformat()} on {len(points)} configs from: {'; '.join(sources)}.",
        f"Error of tokens/s on those configs: median {100 * float(np.median(errors)):.1f} %, "
        f"worst {100 * max(errors):.1f} %.",
        f"Recompute share with checkpointing (token cost on / off - 1): {recompute:.2f}.",
    ]
    if provisional:
        about.append(PROVISIONAL_NOTE)
    about.append("Do not edit by hand: run ``python bench/fit_throughput.py --write`` on the sweep instead.")
    docstring = "\n\n".join(textwrap.fill(paragraph, 100, break_on_hyphens=False) for paragraph in about)
    return f'''"""{docstring}
"""

from __future__ import annotations

from collections.abc import Mapping

PROVISIONAL = {provisional}
#: Seconds per micro-step per byte of 4-bit weights (dequantization), by checkpointing mode.
FIXED_S_PER_BYTE: Mapping[str, float] = {_mapping(result.fixed_s_per_byte)}
#: Seconds per token per multiply-add of the base model's forward, by checkpointing mode.
TOKEN_S: Mapping[str, float] = {_mapping(result.token_s)}
#: Seconds of the optimizer step per adapter parameter, by optimizer kind.
OPTIMIZER_S_PER_PARAM: Mapping[str, float] = {_mapping(result.optimizer_s_per_param)}
#: The per-token part's factor with the embeddings and LM head left in bf16 (bf16_head).
BF16_HEAD_TOKEN_FACTOR = {result.bf16_head_token_factor:.4f}
'''


PROVISIONAL_NOTE = (
    "One shape only (7B, seq 2048): the fixed and the per-token parts of other shapes are "
    "extrapolated; refit on bench/results/throughput-h200-2026-12-01 (three shapes) when it lands."
)


def _mapping(values: dict[str, float]) -> str:
    rows = "".join(f'    "{k}": {v:.6e},\n' for k, v in sorted(values.items()))
    return "{\n" + rows + "}"


def prediction_errors(points: list[Point], result: Fit) -> list[float]:
    return [predicted(p, result) / p.tokens_per_s - 1 for p in points]


def predicted(p: Point, result: Fit) -> float:
    mode = "ckpt" if p.knobs.gradient_checkpointing else "no_ckpt"
    tokens = p.knobs.micro_batch_size * p.knobs.max_seq_len
    micro = result.fixed_s_per_byte[mode] * throughput.weight_bytes(p.shape, p.knobs)
    micro += result.token_s[mode] * tokens * throughput.work_per_token(p.shape, p.knobs.max_seq_len)
    per_param = result.optimizer_s_per_param.get(
        p.knobs.optimizer, result.optimizer_s_per_param["adamw_torch"]
    )
    step = p.knobs.grad_accum * micro + per_param * throughput.adapter_params(p.shape, p.knobs, TARGETS)
    return tokens * p.knobs.grad_accum / step


def table(points: list[Point], result: Fit) -> list[str]:
    lines = [f"{'config':<62} {'measured':>9} {'predicted':>9} {'error':>7}"]
    for p, error in zip(points, prediction_errors(points, result), strict=True):
        lines.append(
            f"{p.label[:62]:<62} {p.tokens_per_s:>9.0f} {predicted(p, result):>9.0f} {100 * error:>+6.1f}%"
        )
    errors = [abs(e) for e in prediction_errors(points, result)]
    lines.append(f"median |error| {100 * float(np.median(errors)):.1f} %, worst {100 * max(errors):.1f} %")
    return lines


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
    result = fit(points)
    print("\n".join(table(points, result)))
    print(f"fixed s/byte {result.fixed_s_per_byte}; token s {result.token_s}")
    print(f"optimizer s/param {result.optimizer_s_per_param}; bf16 head {result.bf16_head_token_factor:.3f}")
    if args.write:
        FIT_MODULE.write_text(render_module(result, sources, points, args.provisional), encoding="utf-8")
        print(f"wrote {FIT_MODULE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
