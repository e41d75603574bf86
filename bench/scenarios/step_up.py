"""Stepping back up on a shared card (issue 34): does a run win back the speed a neighbour cost it?

    python -m bench.scenarios.step_up --out OUT                      # H200, one command, ~7 min
    python -m bench.scenarios.step_up --out /tmp/su --tiny --run-s 60   # the pipeline on the CPU

Two runs of the real ``qlora-supervise run`` on a random-weight Llama shape (hidden 1024, 16
layers, vocabulary 32000; every row longer than ``--seq`` tokens, so every optimizer step trains
``effective batch x seq`` tokens), each stopped by SIGTERM after ``--run-s`` seconds (the child
checkpoints), so "tokens/s over the run" is the steps finished x tokens per step / the run's wall time:

``contention``: micro-batch 8, no checkpointing, ``degrade_on_contention: true``, no speed trial.
Mid-run another process takes the card: at step ``--yield-step`` the child hands its cached memory
back for a few seconds (the injected fault ``QLORA_SUPERVISE_TEST_YIELD_GPU_AT_STEP``, standing in
for the moment a real neighbour gets in: an eval, a save, a longer batch) while a greedy neighbour
grabs all but room for the degraded config (the memory model's peak for it, plus slack, and less
than the peak attempt 1 measured). The next step fails as ``oom_contention``, the ladder degrades,
the neighbour holds the card for ``--hold-s`` seconds (the issue's "few minutes", scaled down, with
``supervise.step_up_settle`` scaled from 120 s to ``--settle-s``) and leaves; the run should step up.

``shared-trial``: micro-batch 2 as written, the pre-flight's speed trial on, while three neighbours
share the card (each holds ``--neighbour-gib`` and runs bf16 matmuls without pause) for
``--share-s`` seconds; then the job goes on alone and should time the trial again.

The table: tokens/s over the run; the degraded (or shared-trial) config's steady tokens/s and what
the run would have made staying in it (its rate after the moment it stepped up or re-timed: an
estimate from the measured rate); the config it would have picked alone (attempt 1's rate in
``contention``; the re-timed trial's choice in ``shared-trial``) and its steady rate. Writes
``OUT/results.json``, ``OUT/table.txt`` and each run's journal, events and status under
``OUT/<name>/``. Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from qlora_supervise.policies import memory_model
from qlora_supervise.trainer_child.contract.spec import Knobs

from .._launch import env_with_root, module_argv
from . import gpu_ladder

GiB = 1 << 30
SMALL = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_hidden_layers": 16,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "max_position_embeddings": 4096,
    "vocab_size": 32000,
}
#: What one CUDA context and the allocator's slack take beside a config's allocated peak.
CONTEXT_SLACK = int(1.5 * GiB)


# --------------------------------------------------------------------------- the neighbours


def hog(mode: str, stop_file: Path, hold_bytes: int) -> int:
    """A neighbour on the card until ``stop_file`` exists: ``share`` holds ``hold_bytes`` and
    multiplies; ``greedy`` waits for ``<stop_file>.go`` (the bytes to leave free, written when the
    run nears the yield: torch is imported by then), then keeps taking memory in 256 MiB blocks
    while more than that is free."""
    import torch

    if not torch.cuda.is_available():  # the CPU pipeline check: a neighbour that holds nothing
        while not stop_file.exists():
            time.sleep(0.2)
        return 0
    held: list[Any] = []
    if mode == "share":
        held.append(torch.empty(hold_bytes, dtype=torch.uint8, device="cuda"))
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        while not stop_file.exists():
            for _ in range(20):
                a = (a @ a).clamp_(-1, 1)
            torch.cuda.synchronize()
        return 0
    block, go = 256 << 20, stop_file.with_suffix(".go")
    held.append(torch.empty(1, device="cuda"))  # the context now, not when the card must be taken
    while not go.exists() and not stop_file.exists():
        time.sleep(0.05)
    leave_bytes = int(go.read_text() or 0) if go.exists() else 0
    while not stop_file.exists():
        free, _ = torch.cuda.mem_get_info()
        if free - block > leave_bytes:
            with contextlib.suppress(torch.OutOfMemoryError):
                held.append(torch.empty(block, dtype=torch.uint8, device="cuda"))
                continue
        time.sleep(0.02)
    return 0


def start_hog(mode: str, stop_file: Path, log: Path, hold: int = 0) -> subprocess.Popen[bytes]:
    argv = [*module_argv(__spec__), "--out", str(stop_file.parent), "--_hog", mode, "--_stop", str(stop_file)]
    argv += ["--_hold", str(hold)]
    with log.open("ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env_with_root())


# --------------------------------------------------------------------------- one run


def write_job(work: Path, run_dir: Path, args: argparse.Namespace, micro: int, trial: bool) -> Path:
    resources = "{gpu: cpu}" if args.tiny else "{gpu: cuda:0}"
    path = work / f"{run_dir.name}.yaml"
    path.write_text(
        f"""\
model: {{path: {work / "model"}}}
data: {{path: {work / "data.jsonl"}, text_field: text, eval_fraction: 0.0}}
lora: {{r: 16, alpha: 32, target_modules: [q_proj, k_proj, v_proj, o_proj]}}
train:
  max_seq_len: {args.seq}
  micro_batch_size: {micro}
  effective_batch_size: {args.effective}
  gradient_checkpointing: false
  optimizer: paged_adamw_8bit
  max_steps: 100000
  save_steps: {args.save_steps}
  logging_steps: 1
  merge: false
resources: {resources}
supervise:
  max_attempts: 8
  hang_timeout: 5m
  backoff_initial: 1s
  backoff_max: 5s
  degrade_on_contention: true
  step_up_settle: {args.settle_s}s
  speed_trial: {str(trial).lower()}
  warm_spare: true
  calibration_store: false
output_dir: {run_dir}
""",
        encoding="utf-8",
    )
    return path


def start_run(job: Path, log: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [*gpu_ladder.cli(), "run", str(job), "--plain"],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )


def stop_run(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM to the run's session (the child checkpoints and the run stops resumable), then wait."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def heartbeats(run_dir: Path, attempt: int) -> list[dict[str, Any]]:
    rows = gpu_ladder.read_jsonl(run_dir / f"attempt-{attempt:03d}" / "child-events.jsonl")
    return [r for r in rows if r.get("event") == "heartbeat" and isinstance(r.get("step"), int)]


def step_rate(beats: list[dict[str, Any]], tokens_per_step: int) -> float | None:
    """Steady tokens/s of an attempt: the steps between the heartbeat of its second trained step and
    its last, over the time between them (the first steps' kernel tuning, the load and the trial
    left out; heartbeats also come between steps, so steps are counted, not beats); None with too few."""
    trained = [b for b in beats if b["step"] > 0 and b.get("stage") != "load"]
    if not trained:
        return None
    start = next((b for b in trained if b["step"] >= trained[0]["step"] + 2), None)
    end = next(b for b in trained if b["step"] == trained[-1]["step"])  # when the last step was reached
    if start is None or end["step"] - start["step"] < 2 or end["time"] <= start["time"]:
        return None
    return (end["step"] - start["step"]) * tokens_per_step / (end["time"] - start["time"])


def wait_for(condition: Any, limit_s: float, tick_s: float = 0.5) -> bool:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(tick_s)
    return False


def contention_room(work: Path, run_dir: Path, fast_peak: int | None) -> int:
    """What the greedy neighbour leaves free: the degraded config's (attempt 1's with checkpointing)
    predicted peak plus slack, and never more than the middle of that and attempt 1's reserved."""
    shape = memory_model.ModelShape.from_config(json.loads((work / "model" / "config.json").read_text()))
    spec = json.loads((run_dir / "attempt-001" / "spec.json").read_text())
    degraded = dataclasses.replace(Knobs(**spec["knobs"]), gradient_checkpointing=True)
    need = memory_model.estimate_peak(shape, degraded) + CONTEXT_SLACK
    return need if fast_peak is None else min(need, (need + fast_peak + CONTEXT_SLACK) // 2)


def run_contention(work: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = work / "contention"
    shutil.rmtree(run_dir, ignore_errors=True)  # a run of its own, never a resume of an earlier bench's
    job = write_job(work, run_dir, args, micro=8, trial=False)
    env = env_with_root()
    env["QLORA_SUPERVISE_TEST_YIELD_GPU_AT_STEP"] = f"{args.yield_step}:{args.yield_pause_s}"
    stop_file = work / "contention.hog-stop"
    stop_file.unlink(missing_ok=True)
    stop_file.with_suffix(".go").unlink(missing_ok=True)
    neighbour = start_hog("greedy", stop_file, out / "contention-neighbour.log")
    t0 = time.monotonic()
    proc = start_run(job, out / "contention-supervisor.log", env)
    notes: dict[str, Any] = {}
    near = lambda: any(b["step"] >= args.yield_step - 6 for b in heartbeats(run_dir, 1))  # noqa: E731
    if wait_for(near, args.run_s / 2):
        peaks = [b.get("reserved_bytes") for b in heartbeats(run_dir, 1)]
        fast_peak = max((p for p in peaks if p), default=None)
        leave = contention_room(work, run_dir, fast_peak)
        notes.update(
            fast_reserved=fast_peak, neighbour_leaves_free=leave, neighbour_at_s=time.monotonic() - t0
        )
        stop_file.with_suffix(".go").write_text(str(leave))
        failed = lambda: bool(gpu_ladder.read_jsonl(run_dir / "attempts.jsonl"))  # noqa: E731
        notes["attempt_1_failed"] = wait_for(failed, 60)
        time.sleep(args.hold_s)
    stop_file.touch()
    left_at = time.time()
    notes["neighbour_left_at_s"] = round(time.monotonic() - t0, 1)
    neighbour.wait(timeout=60)
    time.sleep(max(0.0, args.run_s - (time.monotonic() - t0)))
    notes["wall_s"] = round(time.monotonic() - t0, 1)  # to the SIGTERM, not its checkpoint
    notes["exit_code"] = stop_run(proc)
    return {**notes, **collect(run_dir, out / "contention", args, left_at)}


def run_shared_trial(work: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    run_dir = work / "shared-trial"
    shutil.rmtree(run_dir, ignore_errors=True)  # a run of its own, never a resume of an earlier bench's
    job = write_job(work, run_dir, args, micro=2, trial=True)
    stop_file = work / "shared.hog-stop"
    stop_file.unlink(missing_ok=True)
    hold = int(args.neighbour_gib * GiB)
    neighbours = [start_hog("share", stop_file, out / f"neighbour-{i}.log", hold=hold) for i in range(3)]
    time.sleep(5 if not args.tiny else 0)  # the neighbours are on the card before the job starts
    t0 = time.monotonic()
    proc = start_run(job, out / "shared-trial-supervisor.log", env_with_root())
    time.sleep(args.share_s)
    stop_file.touch()
    left_at = time.time()
    notes: dict[str, Any] = {"neighbours_left_at_s": round(time.monotonic() - t0, 1)}
    for n in neighbours:
        n.wait(timeout=60)
    time.sleep(max(0.0, args.run_s - (time.monotonic() - t0)))
    notes["wall_s"] = round(time.monotonic() - t0, 1)  # to the SIGTERM, not its checkpoint
    notes["exit_code"] = stop_run(proc)
    return {**notes, **collect(run_dir, out / "shared-trial", args, left_at)}


def collect(run_dir: Path, keep: Path, args: argparse.Namespace, left_at: float) -> dict[str, Any]:
    """The journal, the planned restarts, each attempt's config, steps, steady rate (over the whole
    attempt, and alone: after the neighbours left at ``left_at``) and trial."""
    kept = gpu_ladder.collect(run_dir, keep)
    status = subprocess.run([*gpu_ladder.cli(), "status", str(run_dir)], capture_output=True, text=True)
    (keep / "status.txt").write_text(status.stdout + status.stderr, encoding="utf-8")
    per_step = args.effective * args.seq
    attempts = []
    for record in kept["attempts"]:
        number = record["attempt"]
        trial = [
            e
            for e in gpu_ladder.read_jsonl(run_dir / f"attempt-{number:03d}" / "child-events.jsonl")
            if e.get("event") == "speed_trial"
        ]
        attempts.append(
            {
                "attempt": number,
                "outcome": record["outcome"],
                "config": gpu_ladder.knob_batch(record["knobs"]),
                "steps": [record["resumed_from"], record["steps_completed"]],
                "seconds": round(record["ended_at"] - record["started_at"], 1),
                "rate": step_rate(heartbeats(run_dir, number), per_step),
                "rate_alone": step_rate(
                    [b for b in heartbeats(run_dir, number) if b["time"] >= left_at], per_step
                ),
                "rung": (record.get("decision") or {}).get("rung"),
                "why": (record.get("decision") or {}).get("why"),
                "trial": trial[-1] if trial else None,
            }
        )
    planned = [e for e in kept["events"] if e.get("event") in ("step_up", "retime", "step_up_refused")]
    last = max((r["steps_completed"] for r in kept["attempts"]), default=0)
    return {"attempts": attempts, "planned": planned, "steps": last, "tokens_per_step": per_step}


# --------------------------------------------------------------------------- the table


def trial_text(trial: dict[str, Any]) -> str:
    """``micro 8 6120, micro 4+ckpt 4010, micro 16 OOM``: each candidate's measured rate."""
    rows = []
    for r in trial.get("results", []):
        c = r["candidate"]
        rate = f"{r['tokens_per_s']:.0f}" if r.get("tokens_per_s") and not r.get("error") else "failed"
        rows.append(f"micro {c['micro_batch_size']}{'+ckpt' if c['gradient_checkpointing'] else ''} {rate}")
    return ", ".join(rows)


def summary(name: str, result: dict[str, Any]) -> list[str]:
    attempts, wall = result.get("attempts", []), result.get("wall_s") or 0
    over_run = result.get("steps", 0) * result.get("tokens_per_step", 0) / wall if wall else None
    up = next((a for a in attempts if a["rung"] in ("step_up", "retime")), None)
    slow = up or (
        attempts[1] if name == "contention" and len(attempts) > 1 else attempts[0] if attempts else None
    )
    fast = (attempts[0] if name == "contention" else attempts[-1] if up else None) if attempts else None
    stayed = None
    slow_rate = slow and (slow["rate_alone"] or slow["rate"])  # the slower config on the card alone
    if up is not None and slow_rate and wall:
        # The steps made before the planned restart, then the slow config's rate for the rest of the run.
        t_up = sum(a["seconds"] for a in attempts[: attempts.index(up) + 1])
        stayed = (up["steps"][1] * result["tokens_per_step"] + slow_rate * max(0.0, wall - t_up)) / wall
    lines = [f"== {name} ==  wall {wall:.0f} s, {result.get('steps', 0)} steps"]
    for a in attempts:
        trial = a["trial"]
        chose = f", trial (tokens/s): {trial_text(trial)}" if trial else ""
        rate = f"{a['rate']:.0f}" if a["rate"] else "-"
        rate += f" ({a['rate_alone']:.0f} alone)" if a["rate_alone"] else ""
        lines.append(
            f"  attempt {a['attempt']} {a['outcome']:<10} {a['config']:<28}"
            f" steps {a['steps'][0]}->{a['steps'][1]} in {a['seconds']:.0f} s,"
            f" steady {rate} tokens/s{chose} -> {a['rung'] or '-'}"
        )
    lines += [f"  {e['event']}: {e.get('why', '')}" for e in result.get("planned", [])]
    fmt = lambda v: "-" if not v else f"{v:.0f}"  # noqa: E731
    lines.append(
        f"  tokens/s over the run {fmt(over_run)} | staying in the slower config (estimate) {fmt(stayed)}"
        f" ({fmt(slow_rate)} steady, alone)"
        f" | the config it picks alone {fmt(fast and fast['rate'])} steady"
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/step_up"))
    p.add_argument(
        "--tiny", action="store_true", help="the pipeline on the CPU: tiny model, no neighbours' memory"
    )
    p.add_argument("--only", choices=["contention", "shared-trial"])
    p.add_argument("--run-s", type=float, default=170.0, help="each run's wall time before its SIGTERM")
    p.add_argument("--hold-s", type=float, default=45.0, help="how long the neighbour holds the card")
    p.add_argument("--share-s", type=float, default=70.0, help="how long three neighbours share the card")
    p.add_argument("--settle-s", type=float, default=15.0, help="supervise.step_up_settle (default 120 s)")
    p.add_argument("--yield-step", type=int, default=20)
    p.add_argument("--yield-pause-s", type=float, default=6.0)
    p.add_argument("--neighbour-gib", type=float, default=40.0)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--effective", type=int, default=16)
    p.add_argument("--save-steps", type=int, default=20)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--_build", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_hog", help=argparse.SUPPRESS)
    p.add_argument("--_stop", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--_hold", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._hog:
        return hog(args._hog, args._stop, args._hold)
    shape = gpu_ladder.TINY if args.tiny else SMALL
    if args.tiny:
        args.seq = min(args.seq, 128)
    if args._build:
        info = gpu_ladder.build_assets(args.work, shape, "cpu" if args.tiny else "cuda", args.rows, args.seq)
        print("BUILD " + json.dumps(info), flush=True)
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items() if not k.startswith("_")}}
    if not (args.work / "model" / "config.json").is_file():
        build = [*module_argv(__spec__), "--_build", "--out", str(args.out), "--work", str(args.work)]
        build += ["--rows", str(args.rows), "--seq", str(args.seq), *(["--tiny"] if args.tiny else [])]
        done = subprocess.run(build, capture_output=True, text=True, env=env_with_root())
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
    lines: list[str] = []
    scenarios = {"contention": run_contention, "shared-trial": run_shared_trial}
    for name, scenario in scenarios.items():
        if args.only and name != args.only:
            continue
        print(f"running {name} ({args.run_s:.0f} s) ...", flush=True)
        results[name] = scenario(args.work, args.out, args)
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
        lines += summary(name, results[name])
        (args.out / "table.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
