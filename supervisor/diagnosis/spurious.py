"""A spurious OOM: the allocator raised although its own numbers say the request fit (it does not
search the pool again after waiting for stream frees, pytorch/pytorch#189504). A mark, not a kind:
the numbers gain :data:`SPURIOUS_KEY` and the policy retries the config once unchanged. Witnesses:
the child's facts (a block of the request's size in the pool while the step's memory was held) or the
message (free memory at least the request plus :func:`margin`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from qlora_supervise.policies.decide import SPURIOUS_KEY
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.trainer_child.contract.allocator import AllocatorFacts

MIB = 1024**2
MIN_MARGIN_BYTES = 512 * MIB
#: Allocated bytes the message and the facts may differ by with the state unchanged.
SAME_STATE_SLACK = 64 * MIB


def margin(request: int) -> int:
    """How far above ``request`` the free memory must be to call the refusal spurious."""
    return max(request, MIN_MARGIN_BYTES)


def mark(failure: Failure, facts: AllocatorFacts | None = None) -> Failure:
    """``failure`` marked spurious where its numbers (or the child's facts) say the request fit."""
    found = judge(failure.numbers, facts)
    if found is None:
        return failure
    why, room = found
    evidence = f"{failure.evidence}; spurious: {why}: the same config is retried once before any rung"
    return dataclasses.replace(failure, numbers={**failure.numbers, SPURIOUS_KEY: room}, evidence=evidence)


def judge(numbers: Mapping[str, Any], facts: AllocatorFacts | None = None) -> tuple[str, int] | None:
    """Why this OOM is spurious and the bytes that were there for it, or None (module docstring)."""
    return _from_facts(numbers, facts) or _from_message(numbers)


def _from_facts(numbers: Mapping[str, Any], facts: AllocatorFacts | None) -> tuple[str, int] | None:
    if facts is None or not facts.block_for_request:
        return None
    asked = facts.requested_bytes if facts.requested_bytes is not None else numbers.get("tried_to_allocate")
    at_raise = numbers.get("already_allocated")
    if asked is None or at_raise is None or facts.allocated_bytes + SAME_STATE_SLACK < int(at_raise):
        return None  # the step's memory was released in between: the block may be its
    why = (
        f"a free block of {format_bytes(facts.largest_free_block_bytes)} was in the pool for the "
        f"{format_bytes(int(asked))} request, with the step's memory still held "
        f"({format_bytes(facts.allocated_bytes)} allocated)"
    )
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
    if room < int(asked) + margin(int(asked)):
        return None
    return f"{format_bytes(room)} {where}, well above the {format_bytes(int(asked))} requested", room
