"""The child's error report (``spec.error_file``), written atomically on any failure."""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Any

from pydantic import TypeAdapter

from qlora_supervise.trainer_child.contract.allocator_facts import AllocatorFacts, AllocatorPeak
from qlora_supervise.trainer_child.contract.attempt_facts import BatchInFlight
from qlora_supervise.trainer_child.contract.codes import Stage, StageName
from qlora_supervise.trainer_child.contract.oom_message import OomNumbers


@dataclasses.dataclass(frozen=True)
class ErrorReport:
    """What the child knew when it failed. Written atomically to ``spec.error_file``.

    ``step`` is the last *completed* optimizer step. ``oom_numbers``: the OOM message's
    numbers (:class:`~.oom_message.OomNumbers`, written under the keys of
    :func:`~.oom_message.parse_numbers`, bytes as integers). ``memory_stats``: the
    ``torch.cuda.memory_stats()`` dump, kept whole for a person; ``allocator_peak`` is what the
    supervisor reads of it, derived once when the report is built or read (not written).
    ``allocator``: the CUDA allocator's facts read at the OOM (None on the CPU, for a failure
    that is not an OOM, or from a child older than them); ``memory_snapshot``: the path of the
    allocator snapshot dumped at the OOM (``diagnose.memory_history``), else None.

    Like torchelastic's ``ProcessFailure``, the report is read from its JSON once, into these
    typed fields (:meth:`from_json`); nothing re-reads it by key afterwards.
    """

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
    emergency_checkpoint: str | None = None  # path of the checkpoint saved after the failure
    emergency_step: int | None = None
    expandable_segments_active: bool | None = None
    # The checkpoint that failed to load (ExitCode.CHECKPOINT): the original, never a scratch copy.
    damaged_checkpoint: str | None = None
    disk_full: bool = False  # the failure was ENOSPC / EROFS / EDQUOT: see ``disk``
    # {"path", "needed_bytes" (the size of the last checkpoint), "free_bytes", "errno"}
    disk: dict[str, Any] | None = None
    allocator: AllocatorFacts | None = None
    memory_snapshot: str | None = None
    # When the exception was caught (not when the report was written): under torchrun the
    # earliest real failure of all ranks is the cause (supervisor/diagnosis/ranks.py).
    time: float = dataclasses.field(default_factory=time.time)
    rank: int = 0  # torchrun's RANK of the process that wrote it (0 for a single process)
    local_rank: int = 0  # LOCAL_RANK: the GPU index of this rank on its host
    world_size: int = 1
    # The micro-batch a training step's OOM happened on: its data position, row indices, lengths.
    batch: BatchInFlight | None = None
    allocator_peak: AllocatorPeak | None = dataclasses.field(init=False, default=None)

    def __post_init__(self) -> None:
        # Built by hand from plain values too (the child's failure path, the tests): a stage's name,
        # the numbers ``parse_numbers`` found.
        object.__setattr__(self, "stage", Stage.named(self.stage))
        if not isinstance(self.oom_numbers, OomNumbers):
            object.__setattr__(self, "oom_numbers", OomNumbers.from_json(self.oom_numbers))
        object.__setattr__(self, "allocator_peak", AllocatorPeak.from_memory_stats(self.memory_stats))

    def to_json(self) -> str:
        """The report's file: every field as written since the first report (``allocator_peak``,
        derived, is not; ``oom_numbers`` holds only the numbers the message printed)."""
        raw = dataclasses.asdict(self)
        del raw["allocator_peak"]
        raw["oom_numbers"] = self.oom_numbers.to_json()
        return json.dumps(raw, indent=2, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str) -> ErrorReport:
        """Raises ValueError (pydantic's ValidationError) for anything that is not a well-typed report."""
        return _REPORT.validate_json(text)


_REPORT = TypeAdapter(ErrorReport)


#: The last line the child prints to stderr on a failure: ``<prefix><stage>: <type>: <message>``.
#: The stage is the child's own; a log classified without the error report can still read it.
FAILURE_LINE_PREFIX = "trainer child failed in "


def failure_line(stage: str, exception_type: str, message: str) -> str:
    return f"{FAILURE_LINE_PREFIX}{stage}: {exception_type}: {message}"
