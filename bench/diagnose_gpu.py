"""Diagnosis on a real GPU: snapshot cost, resume peak, and capped OOMs judged from allocator facts.

    python bench/diagnose_gpu.py --out OUT [--deadline-s 520]     # H200: one command, < 9 minutes
    python bench/diagnose_gpu.py --out /tmp/d --tiny               # the same logic on the CPU

On the Llama-2-7B-shaped model of ``bench/gpu_ladder.py`` (random weights, built locally, seq
2048), each part runs the real trainer child (``python -m qlora_supervise.trainer_child``), one
fresh process per run:

1. **snapshot overhead**: the same config (micro-batch 1, gradient checkpointing) with
   ``diagnose.memory_history`` off and on; the median tokens/s of the steps after the first two;
2. **resume peak**: the "off" run is uninterrupted and checkpoints at step 4; a second run
   resumes from that checkpoint; the CUDA allocator's peak of each process is compared (the
   resumed one must not be higher);
3. **capped OOMs from allocator facts**: the configs the 8 GiB ladder met (micro-batch 4 without
   and with checkpointing, micro-batch 2 with) under ``gpu_memory_limit: 8GiB``, memory history
   on; each error report's allocator facts, the memory model's predicted peak and the verdict of
   ``classify_exit`` (fragmentation only if the step would have fit); the snapshot each OOM
   wrote is loaded back (the keys PyTorch's memory viewer reads: ``segments``,
   ``device_traces``).

Writes ``OUT/results.json`` and ``OUT/table.txt`` (printed last); each run's directory is kept
under ``--work``. On the CPU (``--tiny``) there is no CUDA allocator: the snapshot is off, the
reports carry no facts, and the OOMs come from ``cpu_memory_limit``. Not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_ladder  # the model builder of the ladder bench, beside this file

from qlora_supervise.policies.memory_model import ModelShape
from qlora_supervise.supervisor.diagnosis.classify import classify_exit
from qlora_supervise.supervisor.diagnosis.failure import ChildExit
from qlora_supervise.supervisor.diagnosis.fragmentation import predicted_fit
from qlora_supervise.supervisor.loop.child import child_env
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DataSpec, DiagnoseSpec, Knobs, TrainSpec

GiB = 1 << 30
MiB = 1 << 20


def knobs(work: Path, seq: int, micro: int, checkpointing: bool, effective: int = 16) -> Knobs:
    return Knobs(
        model=str(work / "model"),
        micro_batch_size=micro,
        grad_accum=effective // micro,
        max_seq_len=seq,
        gradient_checkpointing=checkpointing,
    )


def run_child(
    run: Path,
    k: Knobs,
    args: argparse.Namespace,
    *,
    steps: int,
    cap: int | None,
    history: bool,
    resume_from: str | None = None,
) -> dict[str, Any]:
    """One trainer-child process; its heartbeats, report and snapshot, summarised."""
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    spec = AttemptSpec(
        attempt=1,
        run_dir=str(run),
        knobs=k,
        data=DataSpec(path=str(args.work / "data.jsonl")),
        train=TrainSpec(max_steps=steps, save_steps=4, logging_steps=1),
        events_file=str(run / "events.jsonl"),
        error_file=str(run / "error.json"),
        checkpoints_dir=str(run / "checkpoints"),
        adapter_dir=str(run / "adapter"),
        merged_dir=str(run / "merged"),
        device="cpu" if args.tiny else "auto",
        gpu_memory_limit=None if args.tiny else cap,
        cpu_memory_limit=cap if args.tiny else None,
        heartbeat_interval=2.0,
        resume_from=resume_from,
        diagnose=DiagnoseSpec(memory_history=history, memory_history_entries=args.history_entries),
    )
    (run / "spec.json").write_text(spec.to_json(), encoding="utf-8")
    command = [sys.executable, "-m", "qlora_supervise.trainer_child", "--spec", str(run / "spec.json")]
    t0 = time.monotonic()
    with (run / "child.log").open("w", encoding="utf-8") as log:
        try:
            code = subprocess.run(
                command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_env(dict(os.environ), k),
                timeout=args.child_timeout_s,
                check=False,
            ).returncode
        except subprocess.TimeoutExpired:
            code = None
    return {"exit_code": code, "wall_s": round(time.monotonic() - t0, 1), "spec": spec, **summary(run)}


def summary(run: Path) -> dict[str, Any]:
    events = gpu_ladder.read_jsonl(run / "events.jsonl")
    beats = [e for e in events if e.get("event") == "heartbeat" and isinstance(e.get("tokens_per_s"), float)]
    by_step = {e["step"]: e["tokens_per_s"] for e in beats if e.get("step", 0) > 2}
    peaks = [e["peak_bytes"] for e in events if isinstance(e.get("peak_bytes"), int)]
    return {
        "steps": max((e.get("step", 0) for e in events if isinstance(e.get("step"), int)), default=0),
        "tokens_per_s_median": round(statistics.median(by_step.values()), 1) if by_step else None,
        "peak_bytes": max(peaks, default=None),
        "started_at_step": next((e["from_step"] for e in events if e.get("event") == "resumed"), 0),
    }


def judge_oom(result: dict[str, Any], shape: ModelShape | None, cap: int) -> dict[str, Any]:
    """The child's report classified as the supervisor would: facts + the model's predicted peak."""
    spec: AttemptSpec = result["spec"]
    path = Path(spec.error_file)
    if not path.is_file():
        return {"report": None}
    report = ErrorReport.from_json(path.read_text(encoding="utf-8"))
    fit = predicted_fit(shape, spec.knobs, cap)
    tail = (Path(spec.run_dir) / "child.log").read_text(encoding="utf-8", errors="replace")[-65536:]
    failure = classify_exit(ChildExit(report.exit_code), report, tail, fit=fit)
    out: dict[str, Any] = {
        "stage": report.stage.value,
        "kind": failure.kind.value,
        "evidence": failure.evidence,
        "allocator": dataclasses.asdict(report.allocator) if report.allocator else None,
        "predicted_peak": fit.peak_bytes if fit else None,
        "snapshot": snapshot_check(report.memory_snapshot),
    }
    return out


def snapshot_check(path: str | None) -> dict[str, Any] | None:
    """Load the OOM's snapshot back the way the memory viewer does (a pickled dict)."""
    if path is None or not Path(path).is_file():
        return None
    with open(path, "rb") as handle:
        snap = pickle.load(handle)  # our own child's file
    traces = snap.get("device_traces", [])
    return {
        "path": path,
        "bytes": Path(path).stat().st_size,
        "keys": sorted(snap),
        "segments": len(snap.get("segments", [])),
        "trace_entries": sum(len(t) for t in traces),
    }


def build(args: argparse.Namespace) -> dict[str, Any]:
    if (args.work / "model" / "config.json").is_file():
        return {"reused": str(args.work)}
    shape = gpu_ladder.TINY if args.tiny else gpu_ladder.LLAMA2_7B
    info = gpu_ladder.build_assets(args.work, shape, "cpu" if args.tiny else "cuda", args.rows, args.seq)
    return {k: v for k, v in info.items() if k != "model_dir"}


def parts(args: argparse.Namespace, results: dict[str, Any], save: Any, left: Any) -> list[str]:
    # The three parts in order, each skipped when the deadline cannot hold it (long: one table).
    w, lines = args.work, []
    light = knobs(w, args.seq, 1, True, effective=args.light_effective)
    off = run_child(w / "history-off", light, args, steps=args.steps, cap=None, history=False)
    on = run_child(w / "history-on", light, args, steps=args.steps, cap=None, history=True)
    cost = None
    if off["tokens_per_s_median"] and on["tokens_per_s_median"]:
        cost = round(100 * (1 - on["tokens_per_s_median"] / off["tokens_per_s_median"]), 1)
    results["snapshot_overhead"] = {"off": _plain(off), "on": _plain(on), "cost_percent": cost}
    lines.append(
        f"memory history: {off['tokens_per_s_median']} tokens/s off, {on['tokens_per_s_median']} on "
        f"({cost} % slower), {args.history_entries} entries"
    )
    save()
    checkpoint = w / "history-off" / "checkpoints" / "checkpoint-4"
    if left() > 60 and checkpoint.is_dir():
        copy = w / "resume-source"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(checkpoint.parent, copy)
        resumed = run_child(
            w / "resumed",
            light,
            args,
            steps=args.steps,
            cap=None,
            history=False,
            resume_from=str(copy / "checkpoint-4"),
        )
        results["resume_peak"] = {
            "uninterrupted": off["peak_bytes"],
            "resumed": resumed["peak_bytes"],
            "resumed_from": resumed["started_at_step"],
            "run": _plain(resumed),
        }
        lines.append(
            f"peak: uninterrupted {gb(off['peak_bytes'])}, resumed from step "
            f"{resumed['started_at_step']} {gb(resumed['peak_bytes'])}"
        )
        save()
    cap = args.cap_bytes
    shape = ModelShape.from_config(json.loads((w / "model" / "config.json").read_text(encoding="utf-8")))
    results["capped_ooms"] = {}
    for name, (micro, ckpt) in {
        "micro4": (4, False),
        "micro4-ckpt": (4, True),
        "micro2-ckpt": (2, True),
    }.items():
        if left() < 60:
            lines.append(f"{name}: skipped (deadline)")
            continue
        result = run_child(
            w / f"oom-{name}", knobs(w, args.seq, micro, ckpt), args, steps=3, cap=cap, history=True
        )
        verdict = {**judge_oom(result, shape, cap), "run": _plain(result)}
        results["capped_ooms"][name] = verdict
        facts = verdict.get("allocator") or {}
        lines.append(
            f"{name} under {gb(cap)}: {verdict.get('kind')} ({verdict.get('stage')}), predicted "
            f"{gb(verdict.get('predicted_peak'))}; request {gb(facts.get('requested_bytes'))}, "
            f"free in segments {gb(facts.get('free_in_segments_bytes'))}, largest free block "
            f"{gb(facts.get('largest_free_block_bytes'))}; snapshot "
            f"{(verdict.get('snapshot') or {}).get('trace_entries', 'none')} entries"
        )
        save()
    return lines


def gb(value: Any) -> str:
    return f"{gpu_ladder.gib(value)} GiB"


def _plain(result: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in result.items() if k != "spec"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/diagnose_gpu"))
    p.add_argument("--deadline-s", type=float, default=520.0)
    p.add_argument("--tiny", action="store_true", help="CPU check of this script's logic (tiny model)")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rows", type=int, default=160)
    p.add_argument(
        "--light-effective", type=int, default=4, help="effective batch of the overhead/resume runs"
    )
    p.add_argument(
        "--cap", default="8GiB", help="gpu_memory_limit of the OOM runs (cpu_memory_limit with --tiny)"
    )
    p.add_argument("--history-entries", type=int, default=100_000)
    p.add_argument("--child-timeout-s", type=float, default=150.0)
    p.add_argument("--tiny-headroom-mib", type=int, default=200, help="--tiny: cap = imports + this")
    args = p.parse_args(argv)
    if args.tiny:
        args.seq, args.rows = min(args.seq, 256), min(args.rows, 64)
    from qlora_supervise.supervisor.jobfile.units import parse_bytes

    args.cap_bytes = parse_bytes(args.cap)
    if args.tiny and args.cap == "8GiB":  # the CPU cap: the data segment after imports + a little
        baseline = subprocess.run(
            [sys.executable, "-m", "qlora_supervise.trainer_child.recipe.stack", "--bytes"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()[-1]
        args.cap_bytes = int(baseline) + args.tiny_headroom_mib * MiB
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}

    def save() -> None:
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")

    results["build"] = build(args)
    save()
    lines = parts(args, results, save, lambda: args.deadline_s - (time.monotonic() - start))
    results["total_s"] = round(time.monotonic() - start, 1)
    save()
    lines.append(f"total {results['total_s']} s")
    (args.out / "table.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
