"""Fragmentation judged from facts: would ``expandable_segments`` have let the step fit? With our child's
allocator facts the layout failed (the memory was there, no block of the request's size) and the step fits
when packed (a step of this shape completed, or the model's peak is at most :data:`FIT_SHARE` of the budget:
bench/results/gpu-h200-2026-11-29). Else :mod:`._oom_rules` decides. A spurious OOM: the allocator raised
although its own numbers say the request fit (it does not search the pool again after waiting for stream
frees, pytorch/pytorch#189504); a mark, not a kind: the numbers gain :data:`SPURIOUS_KEY`, the policy retries
the config once unchanged. Witnesses: the child's facts (a block of the request's size in the pool while the
step's memory was held) or the message (free memory at least the request plus max(request, 512 MiB))."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from qlora_supervise.policies import memory_model
from qlora_supervise.policies.decide import SPURIOUS_KEY
from qlora_supervise.supervisor.facts.failure import Failure
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
        peak, budget = format_bytes(self.peak_bytes), format_bytes(self.budget_bytes)
        return f"the step {verb}: {self.source} says {peak} against a budget of {budget}"


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
    if facts is not None and facts.same_shape_peak_bytes is not None and facts.limit_bytes is not None:
        source = f"step {facts.same_shape_step} with this micro-batch shape completed"
        # It ran under this very limit: the peak it reached fits by construction.
        fit = StepFit(min(facts.same_shape_peak_bytes, facts.limit_bytes), facts.limit_bytes, source)
    if facts is None:
        if fit is None or fit.fits:
            return None
        return Verdict(False, f"capacity: {fit.sentence()}", _fit_numbers(fit))
    shown = {
        "allocator_free_in_segments": facts.free_in_segments_bytes,
        "allocator_largest_free_block": facts.largest_free_block_bytes,
        "allocator_inactive_split": facts.inactive_split_bytes,
        **(_fit_numbers(fit) if fit else {}),
    }
    failed, layout = _layout(facts, numbers)
    if not failed:
        return Verdict(False, "capacity: " + layout, shown)
    if fit is None:
        nothing = "no model prediction, no step of this shape"
        return Verdict(False, f"capacity: {layout}, but nothing shows the step fits ({nothing})", shown)
    if not fit.fits:
        return Verdict(False, f"capacity: {layout}, but {fit.sentence()}", shown)
    return Verdict(True, f"{layout}, and {fit.sentence()}", shown)


def _layout(facts: AllocatorFacts, numbers: Mapping[str, Any]) -> tuple[bool, str]:
    """Whether the layout failed (the memory was there, no block of the request's size), and why."""
    asked = facts.requested_bytes if facts.requested_bytes is not None else numbers.get("tried_to_allocate")
    if asked is None:
        return False, "the request's size is unknown"
    asked = int(asked)
    if facts.block_for_request:
        return False, f"a free block of {format_bytes(asked)} existed: the layout did not fail"
    available = facts.free_in_segments_bytes + facts.headroom_bytes
    free, headroom = format_bytes(facts.free_in_segments_bytes), format_bytes(facts.headroom_bytes)
    split = f"{free} free in reserved segments + {headroom} headroom"
    if facts.largest_free_block_bytes >= asked or available < asked:
        what = f"({format_bytes(available)} in all): the memory was not there"
        return False, f"{split} < {format_bytes(asked)} requested {what}"
    largest = format_bytes(facts.largest_free_block_bytes)
    return True, f"{split} ≥ {format_bytes(asked)} requested, yet the largest free block was {largest}"


def _fit_numbers(fit: StepFit) -> dict[str, int]:
    return {"step_peak": fit.peak_bytes, "step_budget": fit.budget_bytes}


MIB = 1024**2
MIN_MARGIN_BYTES = 512 * MIB
#: Allocated bytes the message and the facts may differ by with the state unchanged.
SAME_STATE_SLACK = 64 * MIB


def mark_spurious(failure: Failure, facts: AllocatorFacts | None = None) -> Failure:
    """``failure`` marked spurious where its numbers (or the child's facts) say the request fit."""
    if (found := judge_spurious(failure.numbers, facts)) is None:
        return failure
    why, room = found
    evidence = f"{failure.evidence}; spurious: {why}: the same config is retried once before any rung"
    return replace(failure, numbers={**failure.numbers, SPURIOUS_KEY: room}, evidence=evidence)


def judge_spurious(numbers: Mapping[str, Any], facts: AllocatorFacts | None = None) -> tuple[str, int] | None:
    """Why this OOM is spurious and the bytes that were there for it, or None (module docstring)."""
    return _from_facts(numbers, facts) or _from_message(numbers)


def _from_facts(numbers: Mapping[str, Any], facts: AllocatorFacts | None) -> tuple[str, int] | None:
    if facts is None or not facts.block_for_request:
        return None
    asked = facts.requested_bytes if facts.requested_bytes is not None else numbers.get("tried_to_allocate")
    at_raise = numbers.get("already_allocated")
    if asked is None or at_raise is None or facts.allocated_bytes + SAME_STATE_SLACK < int(at_raise):
        return None  # the step's memory was released in between: the block may be its
    block, request = format_bytes(facts.largest_free_block_bytes), format_bytes(int(asked))
    held = f"with the step's memory still held ({format_bytes(facts.allocated_bytes)} allocated)"
    why = f"a free block of {block} was in the pool for the {request} request, {held}"
    return why, facts.largest_free_block_bytes


def _from_message(numbers: Mapping[str, Any]) -> tuple[str, int] | None:
    asked, free = numbers.get("tried_to_allocate"), numbers.get("free")
    if asked is None or free is None:
        return None
    room, where = int(free), "free on the device"
    allowed, reserved = numbers.get("allowed"), numbers.get("reserved_total")
    if allowed is not None:
        if reserved is None:
            return None  # a cap without the reserved total: the room under it is unknown
        room, where = min(room, int(allowed) - int(reserved)), "left under the cap"
    if room < int(asked) + max(int(asked), MIN_MARGIN_BYTES):
        return None
    return f"{format_bytes(room)} {where}, well above the {format_bytes(int(asked))} requested", room
