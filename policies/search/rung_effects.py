"""What ``plan`` shows of each rung: the rung applied alone to the job as written, its predicted
peak and tokens/s (the throughput model's, or this host's measurements), and its cost class."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qlora_supervise.policies.memory.gpu import DEFAULT_TARGETS, predict
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.policies.rungs import PLAN_RUNGS, CostClass
from qlora_supervise.policies.search import throughput
from qlora_supervise.policies.search.search_result import knob_changes
from qlora_supervise.policies.search.search_state import scaled_peak
from qlora_supervise.trainer_child.contract.spec import Knobs


@dataclass(frozen=True)
class RungEffect:
    """One rung applied alone to the job as written: what it predicts and what it costs."""

    name: str
    cost_class: CostClass
    cost: float  # predicted share of tokens/s lost (negative: faster)
    predicted_peak: int | None  # None: the rung changes nothing here
    changes: dict[str, tuple[Any, Any]]
    tokens_per_s: float | None = None


def rung_effects(
    shape: ModelShape,
    knobs: Knobs,
    targets: tuple[str, ...] | str = DEFAULT_TARGETS,
    scale: float | None = None,
    speed: throughput.SpeedCalibration | None = None,
) -> list[RungEffect]:
    """Each plan rung applied alone to ``knobs``: predicted peak and tokens/s after it."""
    base = throughput.rank_speed(shape, knobs, speed, targets).tokens_per_s
    effects = []
    for rung in PLAN_RUNGS:
        changed = rung.apply(knobs)
        if changed is None or rung.cost is None:
            effects.append(RungEffect(rung.name, rung.cost or CostClass.FREE, 0.0, None, {}))
            continue
        rate = throughput.rank_speed(shape, changed, speed, targets).tokens_per_s
        peak = scaled_peak(predict(shape, changed, targets), scale)
        cost = round(1 - rate / base, 4) if base > 0 else 0.0
        effects.append(RungEffect(rung.name, rung.cost, cost, peak, knob_changes(knobs, changed), rate))
    return effects
