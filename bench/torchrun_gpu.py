"""Two GPUs through torchrun: one capped card's OOM and the recovery, per-rank peaks, tokens/s 1 -> 2 GPUs.

    python bench/torchrun_gpu.py --out OUT [--cap 8GiB] [--deadline-s 540]    # two GPUs
    python bench/torchrun_gpu.py --out /tmp/t --tiny                          # the logic on the CPU (gloo)

What it does:

1. once: builds the Llama-2-7B-shaped model, tokenizer and data of ``bench/gpu_ladder.py`` (random
   weights; ``--tiny``: its tiny shape on the CPU), in a subprocess;
2. ``capped``: ``qlora-supervise run`` on a job with ``nproc_per_node: 2`` (seq 2048, micro-batch 4 x
   accumulation 2 x 2 ranks = 16, no gradient checkpointing), where rank 1 alone is capped to
   ``--cap`` (``QLORA_SUPERVISE_TEST_RANK_GPU_CAP``; ``--tiny``: a data-segment cap after step 2,
   ``QLORA_SUPERVISE_TEST_RANK_CPU_CAP``). Expected: the OOM classified on rank 1 with its stage,
   both ranks restarted with the ladder's change, the run finished with the effective batch kept;
   each attempt's per-rank peaks (``child_exited``'s ``rank_peaks``) and any ``rank_peaks_uneven``;
3. ``scaling``: a config that fits (checkpointing on, micro-batch 2, effective 16) on 1 and then on
   2 GPUs for ``--scale-steps`` steps: tokens/s summed over the ranks (each rank's median heartbeat
   ``tokens_per_s`` after its first step).

Writes ``OUT/results.json`` and ``OUT/table.txt`` (printed last), and each run's journal, events and
status under ``OUT/<name>/``. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from gpu_ladder import LLAMA2_7B, TINY, build_assets, cli, read_jsonl, run_supervised

MIB = 1 << 20
#: --tiny: the data segment of a rank at micro-batch 8, seq 256 is about 960 MiB, at 4 about 755 MiB.
TINY_RANK_CAP = 860 * MIB


def write_job(path: Path, work: Path, run_dir: Path, train: dict[str, Any], ranks: int, tiny: bool) -> Path:
    resources = {"gpu": "cpu" if tiny else "auto", "nproc_per_node": ranks}
    ladder = ["gradient_checkpointing", "halve_micro_batch"]
    job = {
        "model": {"path": str(work / "model")},
        "data": {"path": str(work / "data.jsonl"), "text_field": "text"},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "train": {"optimizer": "paged_adamw_8bit", "logging_steps": 1, "warmup_ratio": 0.0, **train},
        "resources": resources,
        "supervise": {
            "hang_timeout": "5m",
            "backoff_initial": "1s",
            "backoff_max": "5s",
            "ladders": {"oom_forward": ladder, "oom_backward": ladder},
        },
        "output_dir": str(run_dir),
    }
    path.write_text(json.dumps(job, indent=1), encoding="utf-8")  # JSON is YAML
    return path


def supervise(
    name: str, job: Path, run_dir: Path, out: Path, env: dict[str, str], timeout: float
) -> dict[str, Any]:
    """One supervised run with the injected environment; its journal, events and status kept."""
    keep = out / name
    keep.mkdir(parents=True, exist_ok=True)
    shutil.copy(job, keep / "job.yaml")
    saved = dict(os.environ)
    os.environ.update(env)
    try:
        run = run_supervised(job, keep / "supervisor.log", timeout)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    for name_ in ("attempts.jsonl", "events.jsonl"):
        if (run_dir / name_).is_file():
            shutil.copy(run_dir / name_, keep / name_)
    status = subprocess.run([*cli(), "status", str(run_dir)], capture_output=True, text=True)
    (keep / "status.txt").write_text(status.stdout + status.stderr, encoding="utf-8")
    return run


def attempts_of(run_dir: Path) -> list[dict[str, Any]]:
    """Each attempt: outcome, failure (kind, stage, rank), decision, knobs, per-rank peaks."""
    events = read_jsonl(run_dir / "events.jsonl")
    exited = {e.get("attempt"): e for e in events if e.get("event") == "child_exited"}
    rows = []
    for record in read_jsonl(run_dir / "attempts.jsonl"):
        knobs, failure, decision = record["knobs"], record.get("failure") or {}, record.get("decision") or {}
        ranks = knobs.get("world_size", 1)
        rows.append(
            {
                "attempt": record["attempt"],
                "outcome": record["outcome"],
                "kind": failure.get("kind"),
                "stage": failure.get("stage"),
                "rank": failure.get("rank"),
                "local_rank": failure.get("local_rank"),
                "rung": decision.get("rung"),
                "batch": f"{knobs['micro_batch_size']} x {knobs['grad_accum']} x {ranks}",
                "effective": knobs["micro_batch_size"] * knobs["grad_accum"] * ranks,
                "steps": f"{record['resumed_from']} -> {record['steps_completed']}",
                "rank_peaks_gib": {
                    rank: round(peak / (1 << 30), 2)
                    for rank, peak in (exited.get(record["attempt"], {}).get("rank_peaks") or {}).items()
                },
            }
        )
    uneven = [e for e in events if e.get("event") == "rank_peaks_uneven"]
    return rows + ([{"rank_peaks_uneven": uneven}] if uneven else [])


def tokens_per_s(run_dir: Path) -> float | None:
    """Tokens/s of attempt 1 summed over its ranks: each rank's median heartbeat after step 1."""
    total, found = 0.0, False
    for path in sorted((run_dir / "attempt-001").glob("child-events*.jsonl")):
        rates = [
            e["tokens_per_s"]
            for e in read_jsonl(path)
            if e.get("event") == "heartbeat" and (e.get("step") or 0) > 1 and e.get("tokens_per_s")
        ]
        if rates:
            total, found = total + statistics.median(rates), True
    return round(total, 1) if found else None


def main(argv: list[str] | None = None) -> int:
    # The bench's steps in order (build, capped run, the two scaling runs), each bounded by what is
    # left of the deadline, so a slow machine still leaves the results of the steps that ran.
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/torchrun_gpu"))
    p.add_argument("--cap", default="8GiB", help="rank 1's gpu_memory_limit (bytes or a unit: 8GiB)")
    p.add_argument("--deadline-s", type=float, default=540.0)
    p.add_argument("--scale-steps", type=int, default=8)
    p.add_argument("--tiny", action="store_true", help="CPU check of this script: gloo ranks, tiny model")
    p.add_argument("--_build", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    seq = 256 if args.tiny else 2048
    if args._build:
        info = build_assets(
            args.work, TINY if args.tiny else LLAMA2_7B, "cpu" if args.tiny else "cuda", 160, seq
        )
        print("BUILD " + json.dumps(info), flush=True)
        return 0
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}

    def left() -> float:
        return args.deadline_s - (time.monotonic() - start) - 20

    if not (args.work / "model" / "config.json").is_file():
        build = [sys.executable, __file__, "--_build", "--work", str(args.work), "--out", str(args.out)]
        done = subprocess.run([*build, *(["--tiny"] if args.tiny else [])], capture_output=True, text=True)
        lines = [x for x in done.stdout.splitlines() if x.startswith("BUILD ")]
        results["build"] = json.loads(lines[-1][6:]) if lines else {"error": done.stderr[-3000:]}
        if done.returncode != 0:
            (args.out / "results.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
            return 1
    micro = 8 if args.tiny else 4
    capped_train = {
        "max_seq_len": seq,
        "micro_batch_size": micro,
        "effective_batch_size": 16,
        "gradient_checkpointing": False,
        "max_steps": 6,
        "save_steps": 2,
    }
    if args.tiny:
        env = {
            "QLORA_SUPERVISE_TEST_RANK_CPU_CAP": f"1:{TINY_RANK_CAP}",
            "QLORA_SUPERVISE_TEST_CAP_AFTER_STEP": "2",
        }
    else:
        env = {"QLORA_SUPERVISE_TEST_RANK_GPU_CAP": f"1:{_bytes(args.cap)}"}
    run_dir = args.work / "run-capped"
    shutil.rmtree(run_dir, ignore_errors=True)
    job = write_job(args.work / "job-capped.json", args.work, run_dir, capped_train, 2, args.tiny)
    results["capped"] = {
        "run": supervise("capped", job, run_dir, args.out, env, left()),
        "attempts": attempts_of(run_dir),
    }
    scale_train = {**capped_train, "micro_batch_size": 2, "gradient_checkpointing": True}
    scale_train.update(max_steps=args.scale_steps, save_steps=1000)
    results["scaling"] = {}
    for ranks in (1, 2):
        if left() < 60:
            results["scaling"][ranks] = {"skipped": f"{left():.0f} s left"}
            continue
        run_dir = args.work / f"run-scale-{ranks}"
        shutil.rmtree(run_dir, ignore_errors=True)
        job = write_job(
            args.work / f"job-scale-{ranks}.json", args.work, run_dir, scale_train, ranks, args.tiny
        )
        # On the CPU one thread per process, as torchrun gives each rank: a like-for-like comparison.
        threads = {"OMP_NUM_THREADS": "1"} if args.tiny else {}
        run = supervise(f"scale-{ranks}", job, run_dir, args.out, threads, left())
        results["scaling"][ranks] = {"run": run, "tokens_per_s": tokens_per_s(run_dir)}
    results["total_s"] = round(time.monotonic() - start, 1)
    (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    table = render(results)
    (args.out / "table.txt").write_text(table, encoding="utf-8")
    print(table, flush=True)
    return 0


def _bytes(text: str) -> int:
    units = {"GiB": 1 << 30, "MiB": 1 << 20}
    for unit, size in units.items():
        if text.endswith(unit):
            return int(float(text[: -len(unit)]) * size)
    return int(text)


def render(results: dict[str, Any]) -> str:
    lines = ["== capped: rank 1 alone under the cap =="]
    lines.append(f"exit {results['capped']['run']['exit_code']} after {results['capped']['run']['wall_s']} s")
    for row in results["capped"]["attempts"]:
        lines.append("  " + json.dumps(row, default=str))
    lines.append("== scaling: the same config on 1 and 2 ranks ==")
    rates = {ranks: entry.get("tokens_per_s") for ranks, entry in results["scaling"].items()}
    for ranks, entry in results["scaling"].items():
        lines.append(f"  {ranks} rank(s): {entry.get('tokens_per_s') or entry.get('skipped')} tokens/s")
    if rates.get(1) and rates.get(2):
        lines.append(f"  speed-up 1 -> 2: {rates[2] / rates[1]:.2f}x")
    lines.append(f"total {results['total_s']} s")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
