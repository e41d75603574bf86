"""Reading the child's events file as it grows, into a picture of its progress.

The child writes one JSON line per event (``contract.events.event_line``). Progress is a change of
optimizer step or of stage; a heartbeat that repeats the same step and stage is not progress,
so a child whose heartbeat thread lives on while training is stuck is still seen as hung.

Heartbeat lines are read as ``contract.events.Heartbeat`` records (today's keys and older ones); the
peak is the child's ``peak_bytes``, never re-derived here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qlora_supervise.trainer_child.contract.events import Heartbeat, MemoryNumbers


@dataclass
class Progress:
    """What the heartbeats have shown so far in one attempt. Mutable: updated every tick."""

    step: int = 0
    stage: str = "starting"
    loss: float | None = None
    tokens_per_s: float | None = None
    max_steps: int | None = None
    peak_bytes: int | None = None  # the child's own peak (CUDA allocator peak, or data segment on the CPU)
    last_event_at: float | None = None  # monotonic time of the newest line of any kind
    last_progress_at: float | None = None  # monotonic time the step or stage last changed
    finished: bool = False
    events: list[dict[str, Any]] = field(default_factory=list)


class HeartbeatReader:
    """Incremental reader: each :meth:`poll` consumes only the lines written since the last one."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = 0
        self._partial = ""
        self.progress = Progress()

    def poll(self, now: float) -> list[dict[str, Any]]:
        """New events since the last call; updates :attr:`progress`."""
        try:
            with self._path.open("r", encoding="utf-8") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
                self._offset = handle.tell()
        except OSError:
            return []
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()  # a line still being written stays for the next poll
        new = [event for event in map(_parse, lines) if event is not None]
        for event in new:
            self._apply(event, now)
        return new

    def _apply(self, event: dict[str, Any], now: float) -> None:
        p = self.progress
        p.last_event_at = now
        step, stage = event.get("step"), event.get("stage")
        if (isinstance(step, int) and step != p.step) or (isinstance(stage, str) and stage != p.stage):
            p.last_progress_at = now
        if isinstance(step, int):
            p.step = max(p.step, step)
        if isinstance(stage, str):
            p.stage = stage
        beat = Heartbeat.from_fields(event) if event.get("event") == "heartbeat" else None
        if beat is not None:
            p.loss = beat.loss if beat.loss is not None else p.loss
            p.tokens_per_s = beat.tokens_per_s if beat.tokens_per_s is not None else p.tokens_per_s
        if isinstance(event.get("max_steps"), int):
            p.max_steps = event["max_steps"]
        # Other events (``loaded``) carry memory numbers too; the peak rule is the child's.
        peak = (beat.memory if beat is not None else MemoryNumbers.from_fields(event)).peak_bytes
        if peak is not None:
            p.peak_bytes = max(p.peak_bytes or 0, peak)
        if event.get("event") == "finished":
            p.finished = True
        p.events.append(event)


def _parse(line: str) -> dict[str, Any] | None:
    if not line.strip():
        return None
    try:
        value = json.loads(line)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
