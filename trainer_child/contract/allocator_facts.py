"""What the CUDA caching allocator held at the moment of an OOM: the facts fragmentation is judged on.

Part of the contract: the error report carries an :class:`AllocatorFacts` and the supervisor
reads it back. The child reads ``torch.cuda.memory_stats()`` and the
segment list of ``torch.cuda.memory_snapshot()`` inside its ``except`` block, while the failed
step's tensors are still alive (its traceback holds them), and :func:`facts_from_allocator`
reduces them to a few numbers. By then the allocator has already released every wholly free
segment and retried (it does so before it raises), so what free memory is left lies *between*
live blocks: split blocks that cannot be given back.

On the CPU there is no caching allocator to ask: PyTorch's CPU allocator is ``malloc``, which
keeps no reserve of its own that a request could fail to fit in. A CPU report carries no facts
(``allocator`` is None) and its OOM is the stage's; the tests stand in for a GPU with segment
lists in ``memory_snapshot()``'s format and with the numbers of recorded H200 reports.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

#: Requests above this size are served from the large pool only (PyTorch's ``kSmallSize``).
SMALL_POOL_MAX = 1 << 20


@dataclasses.dataclass(frozen=True)
class AllocatorFacts:
    """The allocator at the OOM, in bytes (``None``: not known).

    * ``free_in_segments_bytes``: reserved but not allocated, summed over the free blocks of
      the pool the request needed; ``inactive_split_bytes``: PyTorch's own count of free split
      blocks (``inactive_split_bytes.all.current``), the part no ``empty_cache`` can release.
    * ``largest_free_block_bytes``: the largest single free block of that pool;
      ``block_for_request``: whether a free block of at least the request existed.
    * ``limit_bytes``: what the process may reserve (the per-process cap, else the device's
      total); ``device_free_bytes``: the driver's free memory (``cudaMemGetInfo``).
    * ``same_shape_step`` / ``same_shape_peak_bytes``: the last optimizer step of this attempt
      whose micro-batches had the failed one's shape, and the attempt's peak after it: proof
      that this step fits when memory is laid out well (it already did once).
    """

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
        free = self.device_free_bytes
        candidates = [value for value in (room, free) if value is not None]
        return min(candidates) if candidates else 0


def facts_from_allocator(
    stats: Mapping[str, Any],
    segments: Sequence[Mapping[str, Any]],
    requested: int | None,
    *,
    limit: int | None = None,
    device_free: int | None = None,
) -> AllocatorFacts:
    """Reduce ``memory_stats()`` and ``memory_snapshot()``'s segments to :class:`AllocatorFacts`.

    Only the pool the request could be served from counts: a request above 1 MiB never uses a
    small-pool block, however many are free.
    """
    large_only = requested is not None and requested > SMALL_POOL_MAX
    pool = [seg for seg in segments if not large_only or seg.get("segment_type", "large") == "large"]
    free_blocks = [
        int(block.get("size", 0))
        for seg in pool
        for block in seg.get("blocks", ())
        if block.get("state") == "inactive"
    ]
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
    """The CUDA allocator's peaks of the attempt, from the report's ``memory_stats`` (bytes).

    ``allocated_bytes``: ``allocated_bytes.all.peak``, what tensors held at most, the failed
    step included (the attempt's peak when it failed); ``reserved_bytes``:
    ``reserved_bytes.all.peak``, what the caching allocator held from the driver.
    """

    allocated_bytes: int | None
    reserved_bytes: int | None = None

    @classmethod
    def from_memory_stats(cls, stats: object) -> AllocatorPeak | None:
        """The peaks of a ``torch.cuda.memory_stats()`` dump; None without one (the CPU, an older
        child) or without an integer allocated peak."""
        if not isinstance(stats, Mapping):
            return None
        allocated, reserved = stats.get("allocated_bytes.all.peak"), stats.get("reserved_bytes.all.peak")
        if not _is_bytes(allocated):
            return None
        return cls(allocated, reserved if _is_bytes(reserved) else None)


def _is_bytes(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
