"""What one fault-bench run left behind: finished or not, lost steps, corrupt states, tracebacks.

Lost steps are split by what was possible: an attempt that ended after step S could at best be
resumed from the newest checkpoint that was complete by then (the child says so in its
``checkpoint_saved`` events; a checkpoint the bench damaged does not count). Steps after that
checkpoint are *inherent* to the fault; a resume from anything older is *avoidable*.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.record.journal import read_attempts, read_state

MARKER = "qlora_supervise_complete.json"


def measure(
    run: Any, run_dir: Path, stderr: list[str], damaged: list[str], steps: int, save_steps: int
) -> None:
    """Fill ``run``'s finished, lost_*, corrupt and tracebacks fields from the run directory."""
    records, bad = read_attempts(run_dir / "attempts.jsonl")
    if bad:
        run.corrupt.append(f"journal: {bad} unreadable line(s)")
    if (run_dir / "state.json").exists() and read_state(run_dir / "state.json") is None:
        run.corrupt.append("state.json unreadable")
    run.corrupt.extend(_bad_resumes(run_dir, damaged))
    run.tracebacks = sum(text.count("Traceback") for text in stderr)
    last = records[-1] if records else None
    run.finished = bool(
        run.exits
        and run.exits[-1] == 0
        and last is not None
        and last.outcome == "succeeded"
        # The furthest any attempt trained: an attempt that trained nothing records 0 (issue 21 item 6).
        and max(r.steps_completed for r in records) >= steps
        and (run_dir / "adapter").is_dir()
    )
    saved: set[int] = set()
    for record in records:
        saved |= _saved_steps(run_dir / f"attempt-{record.attempt:03d}", damaged)
        if record.next_resume_from is None:
            continue
        best = max((s for s in saved if s <= record.steps_completed), default=0)
        avoidable = max(0, best - record.next_resume_from)
        run.lost_avoidable += avoidable
        run.lost_inherent += max(0, record.lost_steps - avoidable)


def _saved_steps(attempt_dir: Path, damaged: list[str]) -> set[int]:
    events = attempt_dir / "child-events.jsonl"
    steps: set[int] = set()
    if not events.is_file():
        return steps
    for line in events.read_text(encoding="utf-8", errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("event") == "checkpoint_saved" and str(event.get("path")) not in damaged:
            steps.add(int(event["step"]))
    return steps


def _bad_resumes(run_dir: Path, damaged: list[str]) -> list[str]:
    found = []
    for spec_path in sorted(run_dir.glob("attempt-*/spec.json")):
        try:
            source = json.loads(spec_path.read_text()).get("resume_from")
        except (OSError, ValueError):
            found.append(f"{spec_path.parent.name}: spec.json unreadable")
            continue
        if not source:
            continue
        if str(source) in damaged:
            found.append(f"{spec_path.parent.name} resumed from a damaged checkpoint")
        elif not (Path(source) / MARKER).is_file():
            found.append(f"{spec_path.parent.name} resumed from an incomplete checkpoint")
    return found
