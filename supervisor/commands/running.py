"""The attempt in flight, as ``status`` shows it: number, config, step, tokens/s, since when.

``state.json`` names the attempt the supervisor is running (``in_flight``) before its journal
line exists, which is written only when it ends; without this, ``status`` of a run that trains
overnight said ``attempts: 0`` (issue 21 item 14). The step, stage and speed come from the
attempt's own ``child-events.jsonl`` heartbeats; a missing or unreadable file is "no heartbeat yet".
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.record.attempt_speed import speed_of
from qlora_supervise.supervisor.record.history import config_text
from qlora_supervise.supervisor.record.journal import InFlight, State
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract.events import Heartbeat, read_events


@dataclass(frozen=True)
class Running:
    """The attempt in flight and what its heartbeats said last (None: no heartbeat yet)."""

    flight: InFlight
    step: int | None
    stage: str | None
    tokens_per_s: float | None

    def to_json(self) -> dict[str, Any]:
        """The ``running`` object of ``status --json``."""
        return {
            "attempt": self.flight.number,
            "phase": self.flight.phase.value,
            "knobs": dataclasses.asdict(self.flight.knobs),
            "resumed_from": self.flight.resumed_from,
            "step": self.step,
            "stage": self.stage,
            "tokens_per_s": self.tokens_per_s,
            "pid": self.flight.pid,
            "alive": _alive(self.flight.pid),
            "started_at": self.flight.started_at,
        }

    def lines(self, now: float | None = None) -> list[str]:
        """What ``status`` prints for it: a head line like an attempt's, then its config and speed."""
        f = self.flight
        since = _ago((now if now is not None else time.time()) - f.started_at)
        step = f"at step {self.step}" if self.step is not None else "no heartbeat yet"
        where = f" in {self.stage}" if self.stage else ""
        head = f"attempt {f.number} [{f.phase.value}] running: resumed at {f.resumed_from}, {step}{where}"
        child = f"pid {f.pid}" if _alive(f.pid) else f"its child, pid {f.pid}, is gone: the supervisor died?"
        lines = [f"{head}; since {since} ago ({child})"]
        lines.append(f"  config: {config_text(f.knobs)}")
        if self.tokens_per_s is not None:
            lines.append(f"  speed: {self.tokens_per_s:,.0f} tokens/s (median of its heartbeats)")
        return lines


def events_file(rd: RunDir, state: State | None) -> Path | None:
    """The heartbeats file of the attempt in flight (``status --follow`` prints again when it grows)."""
    flight = state.in_flight if state is not None else None
    return rd.attempt(flight.number).events if flight is not None else None


def running_attempt(rd: RunDir, state: State | None, last_recorded: int) -> Running | None:
    """The attempt ``state`` names in flight, unless the journal already holds its line."""
    flight = state.in_flight if state is not None else None
    if flight is None or flight.number <= last_recorded:
        return None
    events = read_events(rd.attempt(flight.number).events)
    beat = next((event for event in reversed(events) if isinstance(event, Heartbeat)), None)
    speed = speed_of(events, flight.knobs).tokens_per_s
    return Running(flight, beat.step if beat else None, beat.stage.value if beat else None, speed)


def _alive(pid: int | None) -> bool:
    if pid is None:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process of that number: alive, as far as we can tell
    return True


def _ago(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
