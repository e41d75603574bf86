"""Memory creep: a peak that rises step after step (a leak) towards the budget, seen in heartbeats.

A healthy run's peak is flat after warm-up, with rarer jumps at a longer batch; a leak raises it at
every step. Over the last :data:`WINDOW` steps after :data:`WARMUP_STEPS` (where optimizer state
lands), a **leak** is a rise above the noise (:data:`NOISE_FLOOR` or :data:`NOISE_SHARE` of the
peak) in every interval but at most one, with a positive least-squares slope; it **approaches the
budget** when the line reaches it within :data:`HORIZON_STEPS` (the GPU budget for the CUDA
allocator's peak, ``cpu_memory_limit`` for the data segment's). Then :meth:`CreepWatch.observe`
returns a forecast once per attempt and the runner asks the child for an early checkpoint, so the
OOM costs no finished step; a leak without a budget is reported once, without the signal."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from qlora_supervise.trainer_child.contract.events import ChildPeakSource, Heartbeat

WINDOW = 6
WARMUP_STEPS = 2
HORIZON_STEPS = 8
NOISE_FLOOR = 8 * 1024**2
NOISE_SHARE = 0.001


@dataclass(frozen=True)
class CreepForecast:
    step: int
    peak_bytes: int
    slope_bytes_per_step: float
    budget_bytes: int | None
    predicted_oom_step: int | None  # None: no budget to reach
    window_steps: int

    @property
    def asks_for_checkpoint(self) -> bool:
        return self.predicted_oom_step is not None


class CreepWatch:
    """Fed every heartbeat of one attempt; says once when memory creeps towards the budget."""

    def __init__(self, gpu_budget: int | None, cpu_budget: int | None, first_step: int = 0) -> None:
        self._budgets = {ChildPeakSource.CUDA_ALLOCATOR: gpu_budget, ChildPeakSource.DATA_SEGMENT: cpu_budget}
        self._first_step = first_step
        self._peaks: dict[int, int] = {}
        self._source: ChildPeakSource | None = None
        self.fired = False

    def observe(self, beat: Heartbeat) -> CreepForecast | None:
        peak = beat.memory.peak_bytes
        if self.fired or peak is None or beat.step <= self._first_step + WARMUP_STEPS:
            return None
        self._source = beat.memory.peak_source
        self._peaks[beat.step] = max(self._peaks.get(beat.step, 0), peak)
        for old in sorted(self._peaks)[:-WINDOW]:  # only the window is ever read
            del self._peaks[old]
        forecast = self._forecast()
        if forecast is None:
            return None
        budget = forecast.budget_bytes
        if budget is not None and (
            forecast.predicted_oom_step is None or forecast.predicted_oom_step - forecast.step > HORIZON_STEPS
        ):
            return None  # a leak, but the budget is still far: say so when it is near
        self.fired = True
        return forecast

    def _forecast(self) -> CreepForecast | None:
        steps = sorted(self._peaks)[-WINDOW:]
        if len(steps) < WINDOW:
            return None
        peaks = [self._peaks[step] for step in steps]
        noise = max(NOISE_FLOOR, NOISE_SHARE * peaks[-1])
        rises = sum(1 for before, after in itertools.pairwise(peaks) if after - before > noise)
        slope = _slope(steps, peaks)
        if rises < len(steps) - 2 or slope <= 0:
            return None
        budget = self._budgets.get(self._source) if self._source is not None else None
        return CreepForecast(
            step=steps[-1],
            peak_bytes=peaks[-1],
            slope_bytes_per_step=slope,
            budget_bytes=budget,
            predicted_oom_step=_reaches(steps[-1], peaks[-1], slope, budget),
            window_steps=len(steps),
        )


def _slope(steps: list[int], peaks: list[int]) -> float:
    mean_x = sum(steps) / len(steps)
    mean_y = sum(peaks) / len(peaks)
    spread = sum((x - mean_x) ** 2 for x in steps)
    if spread == 0:
        return 0.0
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(steps, peaks, strict=True)) / spread


def _reaches(step: int, peak: int, slope: float, budget: int | None) -> int | None:
    if budget is None:
        return None
    if peak >= budget:
        return step + 1
    return step + max(1, math.ceil((budget - peak) / slope))
