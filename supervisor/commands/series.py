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
from qlora_supervise.trainer_child.contract.events import MemoryNumbers, PeakSource

#: Which current gauge shows the memory each peak source measures.
_GAUGE_OF_SOURCE = {
    PeakSource.CUDA_ALLOCATOR: "allocated_bytes",
    PeakSource.DATA_SEGMENT: "vmdata_bytes",
    PeakSource.RSS: "rss_bytes",
}
_LABEL_OF_SOURCE = {
    PeakSource.CUDA_ALLOCATOR: "CUDA allocated",
    PeakSource.DATA_SEGMENT: "data segment",
    PeakSource.RSS: "RSS",
}


@dataclass
class Series:
    """(wall time, bytes) points of one attempt; ``nvml`` from the GPU monitor, when it ran."""

    points: list[tuple[float, int]] = field(default_factory=list)
    nvml: list[tuple[float, int]] = field(default_factory=list)
    label: str = "memory"


def attempt_series(rd: RunDir, attempt: int) -> Series:
    directory = rd.attempt_dir(attempt)
    series = Series()
    for event in _lines(directory / "child-events.jsonl"):
        numbers = MemoryNumbers.from_fields(event)
        if numbers.peak_source is None or not isinstance(event.get("time"), int | float):
            continue
        value = getattr(numbers, _GAUGE_OF_SOURCE[numbers.peak_source])
        if value:
            series.points.append((float(event["time"]), int(value)))
            series.label = _LABEL_OF_SOURCE[numbers.peak_source]
    for sample in _lines(directory / "gpu.jsonl"):
        if isinstance(sample.get("time"), int | float) and isinstance(sample.get("this_process_bytes"), int):
            series.nvml.append((float(sample["time"]), int(sample["this_process_bytes"])))
    return series


def _lines(path: Path) -> list[dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            out.append(value)
    return out
