"""What an OOM message's numbers say about the cause: contention, fragmentation, or neither.
**Contention**: other processes hold at least half of the GPU (wait, do not degrade). ``others_in_use``
is, with the new wording's "this process has P" clause, ``max(sum of the Process lines, total - free -
max(P, reserved))``, else ``total - free - reserved``. A process that hit its own cap is not contention.
**Fragmentation**: ``reserved_unallocated >= max(512 MiB, min(1 GiB, 5 % of capacity))`` and
``reserved_unallocated + free >= tried_to_allocate`` and allocated + request under 95 % of the
capacity (at 95 % no layout leaves room: bench/results/gpu-h200-2026-11-29). Under a cap the split
memory alone must hold the request: the capped allocator already released its free segments."""

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
    if allocated is not None and "reserved_unallocated" not in out and "reserved_total" in out:
        out["reserved_unallocated"] = max(0, out["reserved_total"] - allocated)
    if allocated is not None and "reserved_total" not in out and "reserved_unallocated" in out:
        out["reserved_total"] = allocated + out["reserved_unallocated"]
    others = others_in_use(out)
    return out if others is None else {**out, "others_in_use": others}


def others_in_use(numbers: Mapping[str, Any]) -> int | None:
    """Bytes other processes hold on the GPU, from a (derived) message's numbers; None: unknown."""
    total, free = _size(numbers, "total_capacity"), _size(numbers, "free")
    reserved, mine = _size(numbers, "reserved_total"), _size(numbers, "process_in_use")
    if mine is not None:
        listed = sum(int(size) for size in numbers.get("processes", {}).values())
        if total is None or free is None:
            return listed
        return max(listed, total - free - max(mine, reserved or 0), 0)
    if total is None or free is None or reserved is None:
        return None
    return max(0, total - free - reserved)


def _size(numbers: Mapping[str, Any], key: str) -> int | None:
    return None if numbers.get(key) is None else int(numbers[key])


def contention(
    numbers: Mapping[str, Any], nvml_others: int | None = None, nvml_total: int | None = None
) -> str | None:
    """Why this is contention (a sentence), or None. NVML's sample counts as a second witness."""
    allowed, tried = numbers.get("allowed"), int(numbers.get("tried_to_allocate") or 0)
    held = numbers.get("reserved_total") or numbers.get("process_in_use") or 0
    if allowed is not None and held + tried > allowed:
        return None  # the process hit its own cap
    message = (numbers.get("total_capacity"), numbers.get("others_in_use"))
    for witness, (total, others) in (("", message), ("NVML: ", (nvml_total, nvml_others))):
        if total and others is not None and others >= CONTENTION_SHARE * total:
            return f"{witness}other processes hold {format_bytes(others)} of {format_bytes(total)} (≥ 50 %)"
    return None


def fragmentation(numbers: Mapping[str, Any]) -> str | None:
    """Why this is fragmentation (a sentence), or None."""
    unallocated, tried = numbers.get("reserved_unallocated"), numbers.get("tried_to_allocate")
    if unallocated is None or tried is None:
        return None
    sizes = [numbers[key] for key in ("total_capacity", "allowed") if numbers.get(key)]
    capacity = min(sizes) if sizes else None
    floor = min(FRAGMENTATION_MIN_BYTES, FRAGMENTATION_MIN_SHARE * capacity) if capacity else GIB
    floor = max(FRAGMENTATION_FLOOR_BYTES, floor)
    if capacity and int(numbers.get("already_allocated") or 0) + tried >= FULL_SHARE * capacity:
        return None
    allowed, reserved = _size(numbers, "allowed"), _size(numbers, "reserved_total")
    if allowed is not None and unallocated < tried:
        return None  # capped: the split memory alone must hold the request (module docstring)
    headroom = int(numbers.get("free") or 0)
    if allowed is not None and reserved is not None:  # under a cap: no more than the cap leaves
        headroom = min(headroom, max(0, allowed - reserved))
    if unallocated >= floor and unallocated + headroom >= tried:
        free, split = format_bytes(headroom), format_bytes(unallocated)
        return f"{split} reserved-unallocated + {free} free ≥ {format_bytes(tried)} requested"
    return None
