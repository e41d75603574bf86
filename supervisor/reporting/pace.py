"""How fast an attempt goes: elapsed time, step rate and ETA, and durations in words."""

from __future__ import annotations

from dataclasses import dataclass

from qlora_supervise.supervisor.watching.heartbeats import Progress


@dataclass(frozen=True)
class Pace:
    """An attempt's pace at one moment. ``eta_s`` is None until a step has been trained."""

    elapsed_s: float
    steps_per_s: float | None
    eta_s: float | None


class PaceMeter:
    """Measures the pace of the current attempt from the step it started (resumed) at."""

    def __init__(self) -> None:
        self._attempt: int | None = None
        self._start_at = 0.0
        self._first_step: int | None = None
        self._first_step_at = 0.0

    def measure(self, attempt: int, progress: Progress, now: float) -> Pace:
        if attempt != self._attempt:
            self._attempt, self._start_at, self._first_step = attempt, now, None
        if self._first_step is None and progress.stage not in ("starting", "setup", "load"):
            # The rate counts from the first training tick, not from the model load.
            self._first_step, self._first_step_at = progress.step, now
        elapsed = now - self._start_at
        if self._first_step is None or progress.step <= self._first_step:
            return Pace(elapsed, None, None)
        rate = (progress.step - self._first_step) / max(1e-9, now - self._first_step_at)
        left = (progress.max_steps or 0) - progress.step
        return Pace(elapsed, rate, left / rate if progress.max_steps and left >= 0 else None)


def human_duration(seconds: float) -> str:
    """``42s``, ``12m05s``, ``2h10m``, ``3d04h``: what a person reads at a glance."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"
