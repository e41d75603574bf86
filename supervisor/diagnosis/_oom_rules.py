"""What an OOM message's numbers say about the cause: contention, fragmentation, or neither.

**Contention** — other processes hold at least half of the GPU
(``others_in_use >= 50 %`` of the total capacity). ``others_in_use`` is what the device has
in use beyond this process: with the new wording's "this process has P" clause, every
``Process N`` line is another process and ``others = max(sum of those lines, total - free -
max(P, reserved))`` (drivers inside containers print 0 bytes per process); without that
clause, and in the old wording, ``others = total - free - reserved``. That also counts our own
non-PyTorch memory (CUDA context, cuBLAS and NCCL workspaces, usually under 1 GiB), which a
threshold of half the card makes irrelevant. Why: when others own most of the card no config
of ours fits in what is left, and the remedy is to wait, not to degrade. A capped process
(``N allowed;``) that hit its own cap is not contention: the cap refused it, not the others.

**Fragmentation** — ``reserved_unallocated >= max(512 MiB, min(1 GiB, 5 % of the capacity))``
**and** ``reserved_unallocated + free >= tried_to_allocate`` **and** what PyTorch has allocated
plus the request stays under 95 % of the capacity. Why: the caching allocator serves a
request from one contiguous block. Reserved-but-unallocated bytes are already ours; when they
plus the device's free bytes cover the request, the memory existed and only its layout (cached
blocks split too small to coalesce) failed, so ``expandable_segments`` or releasing the cache
fixes it and a smaller batch is the wrong remedy. The size floor ignores the allocator's normal
slack (block rounding, size classes, per-stream pools: a few hundred MiB), which is no layout
problem; the 512 MiB floor keeps a small card's 5 % inside that slack. When allocated + request
fill the capacity (≥ 95 %), no layout would have left room to train on: that is a plain OOM of
its stage (seen on the H200 under an 8 GiB cap: 0.49 GiB unallocated, 7.58 + 0.34 of 8 GiB,
and expandable_segments did not help; bench/results/gpu-h200-2026-11-29). With a cap, "free"
is what is left under the cap, and the request must fit **in one piece** of the split memory:
``reserved_unallocated >= tried_to_allocate``. Why: before a capped allocator raises it has
already released every wholly free segment and been refused a new one by the cap, so the
unallocated bytes lie between live blocks, and the cap's unreserved room is another address
range that no layout joins to them; when the split bytes alone cannot hold the request, the
cap, not the layout, refused it. Contention is checked first: when
others hold the card, free memory is scarce for a reason outside the process.

In the old wording ``reserved_unallocated = reserved_total - already_allocated``; in the new
one ``reserved_total = already_allocated + reserved_unallocated``; the pre-1.5 ``X cached`` is
already the unallocated part.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qlora_supervise.supervisor.facts.units import format_bytes

GIB = 1024**3
CONTENTION_SHARE = 0.5
FRAGMENTATION_MIN_BYTES = GIB
FRAGMENTATION_MIN_SHARE = 0.05
FRAGMENTATION_FLOOR_BYTES = 512 * 1024**2
FULL_SHARE = 0.95


def derive(numbers: Mapping[str, Any]) -> dict[str, Any]:
    """``numbers`` plus the reserved split the wording left out and ``others_in_use``."""
    out = dict(numbers)
    allocated = out.get("already_allocated")
    if allocated is not None:
        if "reserved_unallocated" not in out and "reserved_total" in out:
            out["reserved_unallocated"] = max(0, out["reserved_total"] - allocated)
        if "reserved_total" not in out and "reserved_unallocated" in out:
            out["reserved_total"] = allocated + out["reserved_unallocated"]
    others = others_in_use(out)
    if others is not None:
        out["others_in_use"] = others
    return out


def others_in_use(numbers: Mapping[str, Any]) -> int | None:
    """Bytes other processes hold on the GPU, from a (derived) message's numbers; None: unknown."""
    total, free = _size(numbers, "total_capacity"), _size(numbers, "free")
    reserved = _size(numbers, "reserved_total")
    mine = _size(numbers, "process_in_use")
    if mine is not None:
        listed = sum(int(size) for size in numbers.get("processes", {}).values())
        if total is None or free is None:
            return listed
        return max(listed, total - free - max(mine, reserved or 0), 0)
    if total is None or free is None or reserved is None:
        return None
    return max(0, total - free - reserved)


def _size(numbers: Mapping[str, Any], key: str) -> int | None:
    value = numbers.get(key)
    return None if value is None else int(value)


def contention(
    numbers: Mapping[str, Any], nvml_others: int | None = None, nvml_total: int | None = None
) -> str | None:
    """Why this is contention (a sentence), or None. NVML's sample counts as a second witness."""
    if _cap_reached(numbers):
        return None
    total, others = numbers.get("total_capacity"), numbers.get("others_in_use")
    if total and others is not None and others >= CONTENTION_SHARE * total:
        return f"other processes hold {format_bytes(others)} of {format_bytes(total)} (≥ 50 %)"
    if nvml_total and nvml_others is not None and nvml_others >= CONTENTION_SHARE * nvml_total:
        return (
            f"NVML: other processes hold {format_bytes(nvml_others)} of {format_bytes(nvml_total)} (≥ 50 %)"
        )
    return None


def fragmentation(numbers: Mapping[str, Any]) -> str | None:
    """Why this is fragmentation (a sentence), or None."""
    unallocated, tried = numbers.get("reserved_unallocated"), numbers.get("tried_to_allocate")
    if unallocated is None or tried is None:
        return None
    capacity = _capacity(numbers)
    floor = min(FRAGMENTATION_MIN_BYTES, FRAGMENTATION_MIN_SHARE * capacity) if capacity else GIB
    floor = max(FRAGMENTATION_FLOOR_BYTES, floor)
    if capacity and int(numbers.get("already_allocated") or 0) + tried >= FULL_SHARE * capacity:
        return None
    headroom = _headroom(numbers)
    if numbers.get("allowed") is not None and unallocated < tried:
        return None  # capped: the split memory alone must hold the request (module docstring)
    if unallocated >= floor and unallocated + headroom >= tried:
        free, split = format_bytes(headroom), format_bytes(unallocated)
        return f"{split} reserved-unallocated + {free} free ≥ {format_bytes(tried)} requested"
    return None


def _capacity(numbers: Mapping[str, Any]) -> int | None:
    sizes = [numbers[key] for key in ("total_capacity", "allowed") if numbers.get(key)]
    return min(sizes) if sizes else None


def _headroom(numbers: Mapping[str, Any]) -> int:
    free = int(numbers.get("free") or 0)
    allowed, reserved = _size(numbers, "allowed"), _size(numbers, "reserved_total")
    if allowed is not None and reserved is not None:
        return min(free, max(0, allowed - reserved))
    return free


def _cap_reached(numbers: Mapping[str, Any]) -> bool:
    allowed = numbers.get("allowed")
    held = numbers.get("reserved_total") or numbers.get("process_in_use") or 0
    return allowed is not None and held + int(numbers.get("tried_to_allocate") or 0) > allowed
