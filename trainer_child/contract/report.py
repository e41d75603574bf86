"""The child's error report (``spec.error_file``), written atomically on any failure."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from pydantic import TypeAdapter

from qlora_supervise.trainer_child.contract.allocator import AllocatorFacts, AllocatorPeak
from qlora_supervise.trainer_child.contract.attempt_facts import BatchInFlight
from qlora_supervise.trainer_child.contract.codes import Stage, StageName
from qlora_supervise.trainer_child.contract.oom_message import OomNumbers


@dataclasses.dataclass(frozen=True)
class ErrorReport:
    """What the child knew when it failed, read from its JSON once: ``step`` is the last *completed*
    one; ``allocator_peak`` is derived from ``memory_stats`` (not written)."""

    exit_code: int
    exception_type: str
    message: str
    traceback: str
    stage: StageName
    step: int
    is_oom: bool
    config_error: bool = False
    oom_numbers: OomNumbers = dataclasses.field(default_factory=OomNumbers)
    memory_stats: dict[str, Any] | None = None
    device: str = "cpu"
    emergency_checkpoint: str | None = None  # the checkpoint saved after the failure
    emergency_step: int | None = None
    expandable_segments_active: bool | None = None
    damaged_checkpoint: str | None = None  # the original that failed to load, not a scratch copy
    disk_full: bool = False  # ENOSPC / EROFS / EDQUOT
    disk: dict[str, Any] | None = None  # {"path", "needed_bytes", "free_bytes", "errno"}
    allocator: AllocatorFacts | None = None
    memory_snapshot: str | None = None
    time: float = dataclasses.field(default_factory=time.time)  # when caught: the earliest rank's caused it
    rank: int = 0  # torchrun's RANK and LOCAL_RANK (0 for a single process)
    local_rank: int = 0
    world_size: int = 1
    batch: BatchInFlight | None = None  # the micro-batch of a training step's OOM
    allocator_peak: AllocatorPeak | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        # Built from plain values too: a stage's name, the numbers ``parse_numbers`` found.
        object.__setattr__(self, "stage", Stage.named(self.stage))
        if not isinstance(self.oom_numbers, OomNumbers):
            object.__setattr__(self, "oom_numbers", OomNumbers.from_json(self.oom_numbers))
        object.__setattr__(self, "allocator_peak", AllocatorPeak.from_memory_stats(self.memory_stats))

    def to_json(self) -> str:
        """The report's file: every field but the derived ``allocator_peak``."""
        raw = dataclasses.asdict(self)
        del raw["allocator_peak"]
        raw["oom_numbers"] = self.oom_numbers.to_json()
        return json.dumps(raw, indent=2, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str) -> ErrorReport:
        """Raises ValueError (pydantic's ValidationError) for anything but a well-typed report."""
        return _REPORT.validate_json(text)


_REPORT = TypeAdapter(ErrorReport)


#: The last line the child prints to stderr on a failure: ``<prefix><stage>: <type>: <message>``,
#: read where a log is classified without the error report.
FAILURE_LINE_PREFIX = "trainer child failed in "


def failure_line(stage: str, exception_type: str, message: str) -> str:
    return f"{FAILURE_LINE_PREFIX}{stage}: {exception_type}: {message}"
