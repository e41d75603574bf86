"""Fragmentation judged from facts: would ``expandable_segments`` have let the step fit?

``oom_fragmentation`` sends the next attempt to the ``expandable_segments`` rung, which changes
nothing but the allocator's layout. So the verdict must mean exactly that a better layout
would have been enough. For our own child, whose error report carries the allocator's facts at
the OOM (:class:`~qlora_supervise.trainer_child.contract.allocator_facts.AllocatorFacts`), it takes two
things, and both are checked:

1. **The layout failed, not the quantity**: the free memory inside reserved segments plus the
   headroom (what the allocator could still reserve under its limit) covers the request, *and*
   no single free block of the request's size existed (``block_for_request`` false). Free
   split blocks that add up to the request but are each too small are what expandable
   segments cure: they map pages into one growing segment instead of carving fixed ones.
2. **The step fits the budget when perfectly packed**: a step with the same micro-batch shape
   already completed in this attempt (it fit once, so it fits), or the memory model's predicted
   peak for the attempt's knobs (:func:`predicted_fit`) is at most :data:`FIT_SHARE` of the
   budget. The margin leaves the slack no layout removes: the small pool's 2 MiB segments,
   page rounding, and the model's own error (+2 % on the H200 recipe).

Otherwise it is the stage's OOM (capacity). Why the second condition: on a capped card the
message alone cannot tell them apart. Under an 8 GiB cap on the H200 (bench/results/
gpu-h200-2026-11-29) a forward OOM showed 0.93 GiB reserved-but-free against a 344 MiB request,
yet allocated + reserved was 98.5 % of the cap and the step (7B, seq 2048, micro-batch 4,
checkpointing) is predicted at 11.3 GiB: no layout fits 11.3 GiB into 8, and the
``expandable_segments`` attempt that the message rule chose failed again and cost ~22 s.

A prediction that says the step cannot fit vetoes fragmentation for any report of ours, with
or without the facts. A report without facts and without a prediction (an older child, the
CPU, a scripted child) keeps the message-only rule of :mod:`._oom_rules`, as do logs that are
not ours.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qlora_supervise.policies import memory_model
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.trainer_child.contract.allocator_facts import AllocatorFacts
from qlora_supervise.trainer_child.contract.spec import Knobs

#: The share of the budget a perfectly packed step may use and still count as fitting.
FIT_SHARE = 0.97


@dataclass(frozen=True)
class StepFit:
    """What the step needs at its peak against the budget, and who says so."""

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
    """The judgement: fragmentation or capacity, the sentence why, and the numbers that show it."""

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
    """The verdict of the module docstring; None when neither facts nor a prediction exist
    (the caller then applies the message-only rule)."""
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
    """The sentence saying split free memory covered the request with no block big enough."""
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
