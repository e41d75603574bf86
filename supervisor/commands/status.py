"""``qlora-supervise status DIR``: the retry story of a run directory, for a person."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TextIO

from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.supervisor.jobfile.units import format_bytes
from qlora_supervise.supervisor.record.journal import read_attempts, read_state
from qlora_supervise.supervisor.record.records import AttemptRecord
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.protocol import MEMORY_SNAPSHOT_NAME

#: How to read the allocator snapshot an OOM left (``diagnose.memory_history: true``).
SNAPSHOT_HOW_TO = (
    "open https://pytorch.org/memory_viz and drop the file on the page (it runs in the browser; "
    "'Active Memory Timeline' shows what filled the card, 'Allocator State History' the segments)"
)


def status_command(output_dir: str, out: TextIO = sys.stdout) -> int:
    run_dir = RunDir(Path(output_dir))
    if not run_dir.attempts.exists() and not run_dir.state.exists():
        raise SupervisorExit(
            SupervisorExitCode.BAD_JOB,
            f"{output_dir} is not a run directory (no state.json or attempts.jsonl); "
            "pass the job's output_dir",
        )
    print_story(run_dir, out)
    return 0


def print_story(run_dir: RunDir, out: TextIO) -> None:
    state = read_state(run_dir.state)
    records, bad = read_attempts(run_dir.attempts)
    print(f"run directory: {run_dir.root}", file=out)
    if state is not None:
        print(f"state: {state.run_state.value}{f' ({state.note})' if state.note else ''}", file=out)
    for record in records:
        for line in describe(record):
            print(line, file=out)
        snapshot = run_dir.attempt_dir(record.attempt) / MEMORY_SNAPSHOT_NAME
        if snapshot.is_file():
            print(f"  memory snapshot: {snapshot}", file=out)
            print(f"    {SNAPSHOT_HOW_TO}", file=out)
    if bad:
        print(f"({bad} unreadable journal line(s) skipped)", file=out)
    total_lost = sum(r.lost_steps for r in records)
    print(f"attempts: {len(records)}, lost steps in total: {total_lost}", file=out)
    if run_dir.adapter.exists():
        print(f"adapter: {run_dir.adapter}", file=out)


def describe(r: AttemptRecord) -> list[str]:
    """A few lines per attempt: config, outcome, failure, decision, progress kept."""
    k = r.knobs
    config = (
        f"micro_batch {k.micro_batch_size} x accum {k.grad_accum}, seq_len {k.max_seq_len}, "
        f"grad_ckpt {'on' if k.gradient_checkpointing else 'off'}, {k.optimizer}, r {k.lora_r}"
    )
    steps = f"steps {r.resumed_from} -> {r.steps_completed}"
    lines = [f"attempt {r.attempt} [{r.phase.value}] {r.outcome.value}: {steps}"]
    lines.append(f"  config: {config}")
    if r.plan is not None:
        planned = "as written (--as-written)" if r.plan.as_written else "pre-flight"
        peak = format_bytes(r.plan.predicted_peak) if r.plan.predicted_peak else "-"
        budget = format_bytes(r.plan.budget) if r.plan.budget else "-"
        lines.append(f"  plan: {planned}, predicted peak {peak} of {budget}: {r.plan.why[-1]}")
    if r.peak:
        lines.append(f"  peak memory: {format_bytes(r.peak.bytes)} ({r.peak.source.value})")
    if r.failure:
        f = r.failure
        lines.append(f"  failed: {f.kind.value} in {f.stage.value} - {f.evidence}")
        if f.numbers:
            nums = ", ".join(f"{key} {_fmt(value)}" for key, value in f.numbers.items())
            lines.append(f"  numbers: {nums}")
    d = r.decision
    if d is not None and r.restarts:
        changes = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in d.changes.items()) or "no change"
        lines.append(f"  retry: {d.rung}: {changes} ({d.why})")
        lines.append(
            f"  progress kept: {d.survives.value}; next attempt resumes at step {r.next_resume_from}, "
            f"lost {r.lost_steps} step(s)"
        )
    elif d is not None:
        lines.append(f"  gave up: {d.why}")
    return lines


def _fmt(value: object) -> str:
    if isinstance(value, int) and value >= 1024:
        return format_bytes(value)
    return str(value)
