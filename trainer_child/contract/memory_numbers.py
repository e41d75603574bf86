"""The child's memory numbers, written flat into its ``heartbeat`` and ``loaded`` events, and the
one rule that picks its peak."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from pydantic import TypeAdapter


class ChildPeakSource(str, enum.Enum):
    """What :attr:`MemoryNumbers.peak_bytes` measured in the child: the memory its cap limits."""

    CUDA_ALLOCATOR = "cuda_allocator"  # torch.cuda.max_memory_allocated on the training GPU
    DATA_SEGMENT = "data_segment"  # peak VmData on the CPU: what RLIMIT_DATA (cpu_memory_limit) caps
    RSS = "rss"  # VmHWM, where the data segment cannot be read


@dataclasses.dataclass(frozen=True)
class MemoryNumbers:
    """The child's memory at one moment, in bytes (None: not read). ``peak_bytes`` is the attempt's
    one peak so far, chosen by the child (:meth:`measured`); readers never re-derive it."""

    peak_bytes: int | None = None
    peak_source: ChildPeakSource | None = None
    allocated_bytes: int | None = None  # CUDA allocator, now
    reserved_bytes: int | None = None  # CUDA caching allocator's reserve, now
    rss_bytes: int | None = None  # VmRSS, now
    rss_high_water_bytes: int | None = None  # VmHWM
    vmdata_bytes: int | None = None  # VmData, now

    @classmethod
    def measured(
        cls,
        *,
        cuda_peak: int | None,
        data_segment_peak: int | None,
        rss_high_water: int | None,
        allocated: int | None = None,
        reserved: int | None = None,
        rss: int | None = None,
        vmdata: int | None = None,
    ) -> MemoryNumbers:
        """The peak rule: the CUDA allocator's peak on a GPU, else the data segment's, else VmHWM (a
        zero peak, nothing allocated yet, falls through too)."""
        candidates = (
            (cuda_peak, ChildPeakSource.CUDA_ALLOCATOR),
            (data_segment_peak, ChildPeakSource.DATA_SEGMENT),
            (rss_high_water, ChildPeakSource.RSS),
        )
        peak, source = next(((v, s) for v, s in candidates if v), (None, None))
        return cls(peak, source, allocated, reserved, rss, rss_high_water, vmdata)

    def fields(self) -> dict[str, Any]:
        """The JSON fields of an event line (flat, so ``jq .peak_bytes`` reads them)."""
        return dict(_MEMORY.dump_python(self, mode="json"))

    @classmethod
    def from_fields(cls, raw: Mapping[str, Any]) -> MemoryNumbers:
        """The memory fields of an event line read flat (extra keys ignored)."""
        return _MEMORY.validate_python(raw)


_MEMORY = TypeAdapter(MemoryNumbers)
