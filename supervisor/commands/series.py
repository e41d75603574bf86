"""An attempt's memory over time, read from ``attempt-NNN/child-events.jsonl`` and ``gpu.jsonl``.

The child's events carry its own numbers (:class:`MemoryNumbers`): the allocator's current
bytes on a GPU, the data segment on the CPU (what ``cpu_memory_limit`` caps); NVML's samples
(``gpu.jsonl``) add what the driver sees the process hold, CUDA context included. A missing or
torn file gives fewer points, never an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract.events import ChildPeakSource, Heartbeat, Loaded, read_events

#: Which current gauge shows the memory each peak source measures.
_GAUGE_OF_SOURCE = {
    ChildPeakSource.CUDA_ALLOCATOR: "allocated_bytes",
    ChildPeakSource.DATA_SEGMENT: "vmdata_bytes",
    ChildPeakSource.RSS: "rss_bytes",
}
_LABEL_OF_SOURCE = {
    ChildPeakSource.CUDA_ALLOCATOR: "CUDA allocated",
    ChildPeakSource.DATA_SEGMENT: "data segment",
    ChildPeakSource.RSS: "RSS",
}


@dataclass
class Series:
    """(wall time, bytes) points of one attempt; ``nvml`` from the GPU monitor, when it ran."""

    points: list[tuple[float, int]] = field(default_factory=list)
    nvml: list[tuple[float, int]] = field(default_factory=list)
    label: str = "memory"


def attempt_series(rd: RunDir, attempt: int) -> Series:
    files = rd.attempt(attempt)
    series = Series()
    for event in read_events(files.events):
        # The child's memory numbers ride on its heartbeats and its ``loaded`` event.
        if not isinstance(event, Heartbeat | Loaded) or event.time is None:
            continue
        numbers = event.memory
        if numbers.peak_source is None:
            continue
        value = getattr(numbers, _GAUGE_OF_SOURCE[numbers.peak_source])
        if value:
            series.points.append((event.time, int(value)))
            series.label = _LABEL_OF_SOURCE[numbers.peak_source]
    for sample in _lines(files.gpu):
        if isinstance(sample.get("time"), int | float) and isinstance(sample.get("this_process_bytes"), int):
            series.nvml.append((float(sample["time"]), int(sample["this_process_bytes"])))
    return series


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except OSError:
        return ""


def _lines(path: Path) -> list[dict[str, Any]]:
    out = []
    for line in _text(path).splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out
