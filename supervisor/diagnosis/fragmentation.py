"""Fragmentation judged from facts: would ``expandable_segments`` have let the step fit?

``oom_fragmentation`` sends the next attempt to a rung that changes only the allocator's layout,
so the verdict must mean a better layout would have been enough. With our child's allocator facts
(:class:`AllocatorFacts`) both must hold:

1. **the layout failed, not the quantity**: free memory in reserved segments plus headroom covers
   the request, yet no free block of its size existed (``block_for_request`` false);
2. **the step fits when perfectly packed**: a step of the same micro-batch shape completed in this
   attempt, or the memory model's peak (:func:`predicted_fit`) is at most :data:`FIT_SHARE` of the
   budget (the slack no layout removes: 2 MiB small-pool segments, page rounding, model error).

Why 2: on a capped card the message alone cannot tell them apart (bench/results/gpu-h200-2026-11-29:
0.93 GiB reserved-but-free against a 344 MiB request, yet the step was predicted at 11.3 GiB under an
8 GiB cap; the ``expandable_segments`` attempt failed again and cost ~22 s). A prediction that the
step cannot fit vetoes fragmentation for any report of ours; without facts and prediction the
message-only rule of :mod:`._oom_rules` decides, as for logs that are not ours."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qlora_supervise.policies import memory_model
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.trainer_child.contract.allocator import AllocatorFacts
from qlora_supervise.trainer_child.contract.spec import Knobs

#: The share of the budget a perfectly packed step may use and still count as fitting.
FIT_SHARE = 0.97


@dataclass(frozen=True)
class StepFit:
    peak_bytes: int
    budget_bytes: int
    source: str  # "memory model" | "a step of this shape completed"

    @property
    def fits(self) -> bool:
        return self.peak_bytes <= FIT_SHARE * self.budget_bytes

    def sentence(self) -> str:
        verb = "fits" if self.fits else "does not fit"
        return (
            f"the step {verb}: {self.source} says {format_bytes(self.peak_bytes)} "
            f"against a budget of {format_bytes(self.budget_bytes)}"
        )


@dataclass(frozen=True)
class Verdict:
    fragmentation: bool
    why: str
    numbers: Mapping[str, int]


def predicted_fit(
    shape: memory_model.ModelShape | None, knobs: Knobs, budget: int | None, scale: float | None = None
) -> StepFit | None:
    """The memory model's peak for ``knobs`` against ``budget``; None without a shape or budget."""
    if shape is None or budget is None:
        return None
    return StepFit(memory_model.estimate_peak(shape, knobs, scale), budget, "memory model")


def judge(facts: AllocatorFacts | None, numbers: Mapping[str, Any], fit: StepFit | None) -> Verdict | None:
    """The verdict of the module docstring; None without facts or a prediction (the message rule decides)."""
    fit = _observed_fit(facts) or fit
    if facts is None:
        if fit is None or fit.fits:
            return None  # nothing beyond the message: its rule decides
        return Verdict(False, f"capacity: {fit.sentence()}", _fit_numbers(fit))
    shown = {**_fact_numbers(facts), **(_fit_numbers(fit) if fit else {})}
    layout = _layout_failed(facts, numbers)
    if layout is None:
        return Verdict(False, "capacity: " + _quantity_sentence(facts, numbers), shown)
    if fit is None:
        nothing = "no model prediction, no step of this shape"
        why = f"capacity: {layout}, but nothing shows the step fits ({nothing})"
        return Verdict(False, why, shown)
    if not fit.fits:
        return Verdict(False, f"capacity: {layout}, but {fit.sentence()}", shown)
    return Verdict(True, f"{layout}, and {fit.sentence()}", shown)


def _observed_fit(facts: AllocatorFacts | None) -> StepFit | None:
    if facts is None or facts.same_shape_peak_bytes is None or facts.limit_bytes is None:
        return None
    source = f"step {facts.same_shape_step} with this micro-batch shape completed"
    # It ran under this very limit: the peak it reached fits by construction.
    return StepFit(min(facts.same_shape_peak_bytes, facts.limit_bytes), facts.limit_bytes, source)


def _request(facts: AllocatorFacts, numbers: Mapping[str, Any]) -> int | None:
    asked = facts.requested_bytes if facts.requested_bytes is not None else numbers.get("tried_to_allocate")
    return None if asked is None else int(asked)


def _layout_failed(facts: AllocatorFacts, numbers: Mapping[str, Any]) -> str | None:
    asked = _request(facts, numbers)
    if asked is None or facts.block_for_request:
        return None
    if facts.largest_free_block_bytes >= asked:
        return None
    available = facts.free_in_segments_bytes + facts.headroom_bytes
    if available < asked:
        return None
    return (
        f"{format_bytes(facts.free_in_segments_bytes)} free in reserved segments "
        f"+ {format_bytes(facts.headroom_bytes)} headroom ≥ {format_bytes(asked)} requested, "
        f"yet the largest free block was {format_bytes(facts.largest_free_block_bytes)}"
    )


def _quantity_sentence(facts: AllocatorFacts, numbers: Mapping[str, Any]) -> str:
    asked = _request(facts, numbers)
    if asked is None:
        return "the request's size is unknown"
    if facts.block_for_request:
        return f"a free block of {format_bytes(asked)} existed: the layout did not fail"
    available = facts.free_in_segments_bytes + facts.headroom_bytes
    return (
        f"{format_bytes(facts.free_in_segments_bytes)} free in reserved segments "
        f"+ {format_bytes(facts.headroom_bytes)} headroom < {format_bytes(asked)} requested "
        f"({format_bytes(available)} in all): the memory was not there"
    )


def _fact_numbers(facts: AllocatorFacts) -> dict[str, int]:
    return {
        "allocator_free_in_segments": facts.free_in_segments_bytes,
        "allocator_largest_free_block": facts.largest_free_block_bytes,
        "allocator_inactive_split": facts.inactive_split_bytes,
    }


def _fit_numbers(fit: StepFit) -> dict[str, int]:
    return {"step_peak": fit.peak_bytes, "step_budget": fit.budget_bytes}
