"""How fast an attempt goes: elapsed time, step rate and ETA (printed with ``tqdm.format_interval``)."""

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
