"""A spurious OOM: the allocator raised although its own numbers say the request fit.

The caching allocator waits for pending stream frees inside its release and does not search the
pool again after it, so a large-enough block can be back by the time the OOM is raised
(pytorch/pytorch#189504); a driver whose memory came back is the same case. The remedy: run the
config again, unchanged, once (policies/decide.py). Two witnesses, either suffices:

1. **the child's allocator facts**: a free block of at least the request was in the pool *and* the
   step's memory was still held (allocated bytes at least the message's, less
   :data:`SAME_STATE_SLACK`): the child reads its facts after the failed op's temporaries were freed,
   and a block freed afterwards did not exist when the allocator looked;
2. **the message's numbers**: the driver's free memory (under a cap: ``allowed - reserved``) is at
   least the request plus :func:`margin`, far beyond a segment's rounding and a CUDA library's share.

A mark, not a kind: the failure keeps its kind (the ladder if the retry fails alike) and its numbers
gain :data:`SPURIOUS_KEY`, the bytes that were there. Contention is judged before this."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from qlora_supervise.policies.ladder.spurious_retry import SPURIOUS_KEY
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.trainer_child.contract.allocator import AllocatorFacts

MIB = 1024**2
#: The least margin above the request that counts as "well above".
MIN_MARGIN_BYTES = 512 * MIB
#: Allocated bytes that may differ between the message and the facts with the state unchanged
#: (the report's own small tensors, rounding of the printed value).
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
