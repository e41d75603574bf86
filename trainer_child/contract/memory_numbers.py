"""The child's memory numbers in its events, and the one rule that picks its peak.

Standard library only: the child measures them (``run/memory.py``) and writes them flat into
its ``heartbeat`` and ``loaded`` events; the supervisor reads them back with
:meth:`MemoryNumbers.from_fields`, older children's keys included.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from qlora_supervise.trainer_child.contract._event_fields import int_or_none, str_or_none


class ChildPeakSource(str, enum.Enum):
    """What :attr:`MemoryNumbers.peak_bytes` measured in the child: the memory its cap limits."""

    CUDA_ALLOCATOR = "cuda_allocator"  # torch.cuda.max_memory_allocated on the training GPU
    DATA_SEGMENT = "data_segment"  # peak VmData on the CPU: what RLIMIT_DATA (cpu_memory_limit) caps
    RSS = "rss"  # VmHWM, where the data segment cannot be read


#: Keys of the events files written before :class:`MemoryNumbers` existed, in the precedence
#: order of the peak rule (the same order :meth:`MemoryNumbers.measured` applies).
_OLD_PEAK_KEYS = (
    ("peak", ChildPeakSource.CUDA_ALLOCATOR),
    ("peak_vmdata", ChildPeakSource.DATA_SEGMENT),
    ("peak_rss", ChildPeakSource.RSS),
)


_OLD_GAUGE_KEYS = {
    "allocated": "allocated_bytes",
    "reserved": "reserved_bytes",
    "rss": "rss_bytes",
    "vmdata": "vmdata_bytes",
}


@dataclasses.dataclass(frozen=True)
class MemoryNumbers:
    """The child's memory at one moment, in bytes; None where it could not be read.

    ``peak_bytes`` is the one peak of the attempt so far, chosen once, here, by the child
    (:meth:`measured`); readers take it as it is and never re-derive it from the gauges.
    """

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
        """The peak rule: the CUDA allocator's peak on a GPU, else the data segment's, else VmHWM."""
        peak, source = _first_peak(
            (
                (cuda_peak, ChildPeakSource.CUDA_ALLOCATOR),
                (data_segment_peak, ChildPeakSource.DATA_SEGMENT),
                (rss_high_water, ChildPeakSource.RSS),
            )
        )
        return cls(peak, source, allocated, reserved, rss, rss_high_water, vmdata)

    def fields(self) -> dict[str, Any]:
        """The JSON fields of an event line (flat, so ``jq .peak_bytes`` reads them)."""
        values = dataclasses.asdict(self)
        values["peak_source"] = self.peak_source.value if self.peak_source is not None else None
        return values

    @classmethod
    def from_fields(cls, raw: Mapping[str, Any]) -> MemoryNumbers:
        """Read an event's memory fields; ill-typed values become None.

        Events files written before this record (keys ``peak``, ``peak_vmdata``, ``peak_rss``,
        ``allocated``, ``reserved``, ``rss``, ``vmdata``) are read with the same peak rule.
        """
        if "peak_bytes" in raw:
            source = raw.get("peak_source")
            return cls(
                peak_bytes=int_or_none(raw.get("peak_bytes")),
                peak_source=ChildPeakSource(source) if str_or_none(source) in _PEAK_SOURCES else None,
                **{name: int_or_none(raw.get(name)) for name in _GAUGE_FIELDS},
            )
        peak, source = _first_peak(tuple((int_or_none(raw.get(key)), src) for key, src in _OLD_PEAK_KEYS))
        return cls(
            peak_bytes=peak,
            peak_source=source,
            rss_high_water_bytes=int_or_none(raw.get("peak_rss")),
            **{new: int_or_none(raw.get(old)) for old, new in _OLD_GAUGE_KEYS.items()},
        )


_PEAK_SOURCES = frozenset(source.value for source in ChildPeakSource)


_GAUGE_FIELDS = ("allocated_bytes", "reserved_bytes", "rss_bytes", "rss_high_water_bytes", "vmdata_bytes")


def _first_peak(
    candidates: tuple[tuple[int | None, ChildPeakSource], ...],
) -> tuple[int | None, ChildPeakSource | None]:
    # `or` semantics of the old reader: a zero peak (nothing allocated yet) falls through too.
    for value, source in candidates:
        if value:
            return value, source
    return None, None
