"""The CUDA caching allocator: its settings, set by one rule by the supervisor and again by the
child before ``import torch``, and what it held at an OOM (read while the failed step's tensors are
alive, after the allocator released every wholly free segment: the free memory left lies *between*
live blocks). A CPU report carries no facts: ``malloc`` keeps no reserve."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

ALLOC_CONF_VARS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")
EXPANDABLE = "expandable_segments:True"
#: Requests above this size are served from the large pool only (PyTorch's ``kSmallSize``).
SMALL_POOL_MAX = 1 << 20


def allocator_env(env: Mapping[str, str], expandable_segments: bool) -> dict[str, str]:
    """The allocator variables (both names) to set over ``env``, empty when nothing changes; the knob
    wins over an earlier value of its key (a rung after a fragmentation OOM must get it)."""
    if not expandable_segments:
        return {}
    key = EXPANDABLE.split(":", 1)[0] + ":"
    kept = {
        name: [p for p in env.get(name, "").split(",") if p and not p.startswith(key)]
        for name in ALLOC_CONF_VARS
    }
    return {name: ",".join([*parts, EXPANDABLE]) for name, parts in kept.items()}


@dataclasses.dataclass(frozen=True)
class AllocatorFacts:
    """The allocator at the OOM, in bytes (``None``: not known). Free blocks count in the pool the
    request needed; ``inactive_split_bytes`` no ``empty_cache`` can release; ``limit_bytes``: the
    cap, else the device's total. ``same_shape_step`` / ``same_shape_peak_bytes``: the last step with
    the failed micro-batch's shape and the peak after it: proof the step fits when laid out well."""

    requested_bytes: int | None
    allocated_bytes: int
    reserved_bytes: int
    free_in_segments_bytes: int
    inactive_split_bytes: int
    largest_free_block_bytes: int
    block_for_request: bool | None
    segments: int
    limit_bytes: int | None = None
    device_free_bytes: int | None = None
    expandable_segments: bool | None = None
    batch_shape: tuple[int, ...] | None = None
    same_shape_step: int | None = None
    same_shape_peak_bytes: int | None = None

    @property
    def headroom_bytes(self) -> int:
        """What the allocator could still reserve: below the limit and free on the device."""
        room = None if self.limit_bytes is None else max(0, self.limit_bytes - self.reserved_bytes)
        return min((v for v in (room, self.device_free_bytes) if v is not None), default=0)


def facts_from_allocator(
    stats: Mapping[str, Any],
    segments: Sequence[Mapping[str, Any]],
    requested: int | None,
    *,
    limit: int | None = None,
    device_free: int | None = None,
) -> AllocatorFacts:
    """``memory_stats()`` and ``memory_snapshot()``'s segments, in the pool the request could use."""
    large_only = requested is not None and requested > SMALL_POOL_MAX
    pool = [seg for seg in segments if not large_only or seg.get("segment_type", "large") == "large"]
    blocks = [block for seg in pool for block in seg.get("blocks", ())]
    free_blocks = [int(block.get("size", 0)) for block in blocks if block.get("state") == "inactive"]
    largest = max(free_blocks, default=0)
    expandable = [bool(seg["is_expandable"]) for seg in segments if "is_expandable" in seg]
    return AllocatorFacts(
        requested_bytes=requested,
        allocated_bytes=int(stats.get("allocated_bytes.all.current", 0)),
        reserved_bytes=int(stats.get("reserved_bytes.all.current", 0)),
        free_in_segments_bytes=sum(free_blocks),
        inactive_split_bytes=int(stats.get("inactive_split_bytes.all.current", 0)),
        largest_free_block_bytes=largest,
        block_for_request=None if requested is None else largest >= requested,
        segments=len(segments),
        limit_bytes=limit,
        device_free_bytes=device_free,
        expandable_segments=all(expandable) if expandable else None,
    )


@dataclasses.dataclass(frozen=True)
class AllocatorPeak:
    """The attempt's allocated and reserved peaks from the report's ``memory_stats`` (bytes)."""

    allocated_bytes: int | None
    reserved_bytes: int | None = None

    @classmethod
    def from_memory_stats(cls, stats: object) -> AllocatorPeak | None:
        """None without a stats dump (the CPU, an older child) or an integer allocated peak."""
        if not isinstance(stats, Mapping):
            return None
        peaks = (stats.get(f"{kind}_bytes.all.peak") for kind in ("allocated", "reserved"))
        allocated, reserved = (got if type(got) is int else None for got in peaks)  # no bool, no float
        return None if allocated is None else cls(allocated, reserved)
