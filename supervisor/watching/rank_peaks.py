"""Each rank's peak memory under torchrun, and the seeds' "uneven per-card batches" check: with DDP
every rank holds the same replica, so one rank's peak well above the others' points at uneven
batches, sync buffers or a device_map that put more on one card."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path

from qlora_supervise.supervisor.watching.heartbeats import HeartbeatReader
from qlora_supervise.trainer_child.contract.spec import rank_files

UNEVEN_SHARE = 0.2  # "well above": the highest exceeds the lowest by this share of it
UNEVEN_MIN_BYTES = 64 * 1024 * 1024  # ... and by this many bytes (small models differ by noise)


@dataclasses.dataclass(frozen=True)
class UnevenPeaks:
    """One rank peaked well above the others (bytes)."""

    high_rank: int
    high_bytes: int
    low_rank: int
    low_bytes: int

    @property
    def share_above(self) -> float:
        return (self.high_bytes - self.low_bytes) / self.low_bytes


def read_rank_peaks(events_file: Path) -> dict[int, int]:
    """``{rank: peak bytes}`` from each rank's events file; a rank without a reading is left out."""
    peaks: dict[int, int] = {}
    for rank, path in rank_files(str(events_file)):
        reader = HeartbeatReader(Path(path))
        reader.poll(0.0)
        if reader.progress.peak_bytes:
            peaks[rank] = reader.progress.peak_bytes
    return peaks


def uneven(peaks: Mapping[int, int]) -> UnevenPeaks | None:
    """The highest and lowest rank when one peaked well above; None with fewer than two or none."""
    if len(peaks) < 2:
        return None
    high = max(peaks, key=lambda rank: (peaks[rank], -rank))
    low = min(peaks, key=lambda rank: (peaks[rank], rank))
    gap = peaks[high] - peaks[low]
    if gap < UNEVEN_MIN_BYTES or gap < UNEVEN_SHARE * peaks[low]:
        return None
    return UnevenPeaks(high, peaks[high], low, peaks[low])
