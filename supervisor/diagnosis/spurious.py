"""A spurious OOM: the allocator raised although its own numbers say the request fit.

PyTorch's caching allocator, on a failed request, looks for a free block, asks the driver for a
new segment, releases its cached blocks and asks again; the wait for frees still pending on a
stream event (``record_stream``) happens inside that release, and the pool is not searched
again after it. So a block large enough can be back in the pool by the time the OOM is raised,
and the same call made again at once succeeds (pytorch/pytorch#189504, open in 2026). A driver
whose free memory came back between the refusal and the message is the same case seen from
outside. Either way the config was not too big: the remedy is to run it again, unchanged,
once; a second identical failure is no accident and takes the ladder of its stage
(policies/decide.py).

Two witnesses, either suffices:

1. **the child's allocator facts** (our own child, :class:`AllocatorFacts`): a free block of at
   least the request was in the pool (``block_for_request``) *and* nothing the failed step
   held was freed between the raise and the facts (the facts' allocated bytes are at least the
   message's, less :data:`SAME_STATE_SLACK`). Without the second condition a free block says
   nothing: the child reads its facts in its ``except`` block, after the failed operation's own
   temporaries were released (on the H200, 0.7 GiB under an 8 GiB cap), and a block that was
   freed afterwards did not exist when the allocator looked.
2. **the message's numbers** (any log): the memory the allocator could still have taken is well
   above the request: the driver's free memory, and with a cap (``N allowed;``) what is left
   under the cap (``allowed - reserved``); "well above" is at least the request plus
   :func:`margin` (the request again, and never less than 512 MiB), far beyond the rounding of
   a segment (2 MiB, 20 MiB for mid-size requests) and the few hundred MiB a CUDA library may
   take beside PyTorch. An allocator that was refused what the driver still had was not short of
   memory.

The verdict is a mark, not a kind: the failure keeps the kind its stage or layout gives it (the
ladder to take if the retry fails the same way), and its numbers gain :data:`SPURIOUS_KEY`, the
bytes the allocator could still have served the request from, which the policy reads.
Contention is judged before this (other processes holding the card is a reason, not an accident).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from qlora_supervise.policies.ladder.spurious_retry import SPURIOUS_KEY
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.trainer_child.contract.allocator_facts import AllocatorFacts

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
