"""Loss parity of the bf16 head (``Knobs.bf16_head``) against the usual fp32 upcast, on the CPU tiny model.

    python bench/bf16_head_parity.py [--steps 200] [--out bench/results/bf16-head-parity-cpu-2026-12-01]

Trains the tiny Llama model (``recipe/tiny.py``, built under ``--work`` when missing) through the
real trainer child twice, ``--steps`` optimizer steps each, with the same seed, data, order and
LoRA initialisation: once as the recipe has always done (``prepare_model_for_kbit_training``
upcasts the embeddings and LM head to fp32), once with ``bf16_head`` (they stay in the compute
dtype). Prints, and writes to ``OUT/parity.txt`` and ``OUT/parity.json``: the absolute loss
difference per step (max, mean, and over the last 50 steps), each way's first and final loss, its
peak data segment (what RLIMIT_DATA caps) and its median tokens/s.

Why ``compute_dtype: bf16``: on the CPU the recipe computes in fp32 (``qlora.compute_dtype``), the
model is loaded in fp32, nothing is upcast, and the bf16 head would be the fp32 head, a comparison
of a run with itself. ``train.compute_dtype: bf16`` (which the recipe allows on the CPU) loads the
non-4-bit weights in bf16 and dequantizes the 4-bit ones to bf16, so the upcast run has fp32
embeddings and head and the bf16-head run bf16 ones, as on a GPU. What the CPU path cannot copy is
the GPU's autocast (Trainer's bf16 autocast runs only on CUDA here): without it the hidden states
after the first fp32 norm are fp32 in both runs, so the difference measured here is the bf16
embedding output through the first layer's norm (rounded to bf16 there) and the head's weight
tiles in trl's fused loss. The H200 measurement of the same knob (8B shape, autocast) is
``bench/head_parity.py``'s. Not a test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _child import child_env, events, log_tail, make_spec, start_child

from qlora_supervise.trainer_child.contract.codes import ExitCode
from qlora_supervise.trainer_child.contract.spec import AttemptSpec

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "bench" / "results" / "bf16-head-parity-cpu-2026-12-01"
#: Small steps, so that 200 of them take minutes on two shared cores: micro-batch 1, seq 32.
KNOBS = {"micro_batch_size": 1, "grad_accum": 1, "max_seq_len": 32, "gradient_checkpointing": False}
LAST = 50
#: Window of the mean-loss table: at micro-batch 1 one step's loss is one sample's, and two runs that
#: differ in rounding part ways step by step within tens of steps (the trajectory is chaotic at this
#: learning rate), so the curves are compared as window means.
WINDOW = 25


def tiny_model(work: Path) -> Path:
    tiny = work / "tiny"
    if not (tiny / "model").is_dir():
        module = "qlora_supervise.trainer_child.recipe.tiny"
        command = [sys.executable, "-m", module, str(tiny)]
        subprocess.run(command, check=True, env=child_env(), capture_output=True)
    return tiny


def spec_for(tiny: Path, run_dir: Path, steps: int, bf16_head: bool, dtype: str) -> AttemptSpec:
    return make_spec(
        tiny,
        run_dir,
        knobs={**KNOBS, "bf16_head": bf16_head},
        # A constant learning rate after no warm-up, so late steps still move the weights.
        train={
            "max_steps": steps,
            "save_steps": 10 * steps,
            "lr_scheduler": "constant",
            "compute_dtype": dtype,
        },
        heartbeat_interval=30.0,
    )


def train_both(specs: dict[str, AttemptSpec]) -> dict[str, dict[str, Any]]:
    """The runs side by side (one core each), then their per-step losses, peaks and speeds."""
    started = time.monotonic()
    children = {name: start_child(spec) for name, spec in specs.items()}
    runs = {}
    for name, child in children.items():
        code = child.wait(timeout=7200)
        if code != ExitCode.OK:
            raise SystemExit(f"{name}: child exited {code}: {log_tail(specs[name])}")
        runs[name] = summarise(specs[name], time.monotonic() - started)
    return runs


def reuse(specs: dict[str, AttemptSpec]) -> dict[str, dict[str, Any]]:
    """The runs' results from their events files (``--reuse``); wall time from their first and last line."""
    runs = {}
    for name, spec in specs.items():
        lines = events(spec)
        runs[name] = summarise(spec, lines[-1]["time"] - lines[0]["time"])
    return runs


def summarise(spec: AttemptSpec, seconds: float) -> dict[str, Any]:
    lines = events(spec)
    beats = [e for e in lines if e["event"] == "heartbeat" and e.get("loss") is not None]
    losses = {int(e["step"]): float(e["loss"]) for e in beats}
    rates = [float(e["tokens_per_s"]) for e in beats if e.get("tokens_per_s")]
    peaks = [int(e["peak_bytes"]) for e in lines if e.get("peak_bytes")]
    loaded = next(e for e in lines if e["event"] == "loaded")
    return {
        "losses": [losses[step] for step in sorted(losses)],
        "peak_bytes": max(peaks),
        "tokens_per_s": statistics.median(rates),
        "dtype": loaded.get("dtype"),
        "wall_s": round(seconds, 1),
    }


def compare(upcast: dict[str, Any], bf16: dict[str, Any]) -> dict[str, Any]:
    pairs = list(zip(upcast["losses"], bf16["losses"], strict=True))
    diffs = [abs(a - b) for a, b in pairs]
    return {
        "steps": len(pairs),
        "max_abs_diff": max(diffs),
        "mean_abs_diff": statistics.fmean(diffs),
        "mean_abs_diff_last": statistics.fmean(diffs[-LAST:]),
        "max_rel_diff": max(d / abs(a) for d, (a, _) in zip(diffs, pairs, strict=True)),
        "steps_equal": sum(d == 0.0 for d in diffs),
        "first_step_over_1e-2": next((i + 1 for i, d in enumerate(diffs) if d > 1e-2), None),
        "windows": [
            {
                "steps": f"{start + 1}-{start + len(chunk)}",
                "upcast_mean": statistics.fmean(a for a, _ in chunk),
                "bf16_mean": statistics.fmean(b for _, b in chunk),
                "max_abs_diff": max(abs(a - b) for a, b in chunk),
            }
            for start in range(0, len(pairs), WINDOW)
            if (chunk := pairs[start : start + WINDOW])
        ],
    }


def table(runs: dict[str, dict[str, Any]], parity: dict[str, Any], args: argparse.Namespace) -> str:
    mib = 2**20
    out = [
        f"bf16 head vs fp32 upcast, CPU tiny model (hidden 256, 4 layers, vocab 1024), 4-bit NF4, "
        f"compute {args.compute_dtype}, micro-batch {KNOBS['micro_batch_size']}, seq {KNOBS['max_seq_len']}, "
        f"{parity['steps']} optimizer steps, same seed/data/order",
        "(peak: the data segment's, weights and host allocator included; tokens/s of two runs side by side "
        "on shared cores, comparable with each other only)",
        "",
        f"{'':10} {'first loss':>10} {'final loss':>10} {'peak data segment':>18} "
        f"{'tokens/s':>9} {'wall s':>7}  (side by side, one core each)",
    ]
    for name, run in runs.items():
        out.append(
            f"{name:10} {run['losses'][0]:10.4f} {run['losses'][-1]:10.4f} "
            f"{run['peak_bytes'] / mib:14.1f} MiB {run['tokens_per_s']:9.1f} {run['wall_s']:7.1f}"
        )
    out += [
        "",
        f"|loss difference| per step: max {parity['max_abs_diff']:.2e}, mean {parity['mean_abs_diff']:.2e}, "
        f"mean over the last {LAST} steps {parity['mean_abs_diff_last']:.2e}; "
        f"max relative {parity['max_rel_diff']:.2e}; steps with equal loss {parity['steps_equal']}; "
        f"first step differing by more than 1e-2: {parity['first_step_over_1e-2']}",
        "",
        f"mean loss per {WINDOW} steps   upcast  bf16 head  difference  max |step difference|",
    ]
    for w in parity["windows"]:
        delta = w["bf16_mean"] - w["upcast_mean"]
        out.append(
            f"  steps {w['steps']:>9}   {w['upcast_mean']:7.4f}  {w['bf16_mean']:9.4f}  {delta:+10.4f}"
            f"  {w['max_abs_diff']:10.4f}"
        )
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--work", type=Path, default=Path("/tmp/bf16-head-parity"))
    parser.add_argument("--compute-dtype", default="bf16", help="train.compute_dtype (see the docstring)")
    parser.add_argument("--reuse", action="store_true", help="summarise the finished runs in --work again")
    args = parser.parse_args()
    tiny = tiny_model(args.work)
    variants = {"upcast": ("run-upcast", False), "bf16 head": ("run-bf16-head", True)}
    specs = {
        name: spec_for(tiny, args.work / folder, args.steps, bf16_head, args.compute_dtype)
        for name, (folder, bf16_head) in variants.items()
    }
    runs = reuse(specs) if args.reuse else train_both(specs)
    parity = compare(runs["upcast"], runs["bf16 head"])
    text = table(runs, parity, args)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "parity.txt").write_text(text + "\n")
    record = {"knobs": KNOBS, "compute_dtype": args.compute_dtype, "parity": parity, "runs": runs}
    (args.out / "parity.json").write_text(json.dumps(record, indent=1) + "\n")
    for name, spec in specs.items():  # the raw evidence: every heartbeat of both runs
        shutil.copyfile(spec.events_file, args.out / f"events-{name.replace(' ', '-')}.jsonl")


if __name__ == "__main__":
    main()
