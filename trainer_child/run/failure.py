"""What went wrong: exception → exit code, OOM numbers, and the error report.

The report is built from a :class:`CapturedFailure` made of strings only, so that the
exception (and the activations its traceback frames keep alive) can be dropped before any
memory is needed again.
"""

from __future__ import annotations

import dataclasses
import re
import time
import traceback
from typing import Any

from qlora_supervise.trainer_child.contract.allocator_facts import AllocatorFacts
from qlora_supervise.trainer_child.contract.attempt_facts import BatchInFlight
from qlora_supervise.trainer_child.contract.checkpoints import CheckpointLoadError
from qlora_supervise.trainer_child.contract.codes import ExitCode, Stage
from qlora_supervise.trainer_child.contract.disk_space import exception_chain, is_disk_full
from qlora_supervise.trainer_child.contract.durable import write_text_atomic
from qlora_supervise.trainer_child.contract.oom_message import OomNumbers
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.run.torchrun import SINGLE, RankPlace

OOM_MARKERS = (
    "CUDA out of memory",
    "out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "Cannot allocate memory",
)
_CPU_TRIED = re.compile(r"you tried to allocate (\d+) bytes")


class ConfigError(Exception):
    """The job cannot work as written (model, data, fields, target_modules, caps): never retried."""


def is_oom(exc: BaseException) -> bool:
    import torch

    for item in exception_chain(exc):
        if isinstance(item, (torch.OutOfMemoryError, MemoryError)):
            return True
        if any(marker in str(item) for marker in OOM_MARKERS):
            return True
    return False


def is_config_error(exc: BaseException) -> bool:
    return any(isinstance(item, ConfigError) for item in exception_chain(exc))


def is_checkpoint_error(exc: BaseException) -> bool:
    return any(isinstance(item, CheckpointLoadError) for item in exception_chain(exc))


def oom_numbers(message: str) -> dict[str, int]:
    """Numbers of an OOM message; the parser lives in ``oom_message`` (written separately),
    the CPU allocator's ``you tried to allocate N bytes`` is read here in any case."""
    numbers: dict[str, int] = {}
    try:
        from qlora_supervise.trainer_child.contract.oom_message import parse_numbers

        numbers.update(parse_numbers(message))
    except Exception:  # module missing or parser bug: the report matters more
        pass
    match = _CPU_TRIED.search(message)
    if match and "tried_to_allocate" not in numbers:
        numbers["tried_to_allocate"] = int(match.group(1))
    return numbers


@dataclasses.dataclass
class CapturedFailure:
    """An exception reduced to strings plus where the child was when it happened."""

    exception_type: str
    message: str
    traceback: str
    stage: Stage
    step: int
    oom: bool
    config: bool
    checkpoint: bool = False  # the resume checkpoint did not load (an OOM while loading is an OOM)
    disk_full: bool = False  # ENOSPC / EROFS / EDQUOT (see disk_space): wait for room, not a rung
    # Read at the OOM, before the step's tensors are freed (memory.allocator_facts_at_oom).
    allocator: AllocatorFacts | None = None
    memory_snapshot: str | None = None
    batch: BatchInFlight | None = None  # the micro-batch a training step's OOM happened on
    time: float = dataclasses.field(default_factory=time.time)  # when the exception was caught

    @property
    def device_oom(self) -> bool:
        """An accelerator's allocator ran out (torch.OutOfMemoryError: CUDA, also cudaMallocAsync's
        wording), not the host: the CPU allocator raises RuntimeError, Python MemoryError."""
        return self.oom and self.exception_type == "OutOfMemoryError"

    @property
    def exit_code(self) -> ExitCode:
        if self.config:
            return ExitCode.CONFIG
        if self.disk_full:
            return ExitCode.DISK_FULL
        if self.oom:
            return ExitCode.OOM
        return ExitCode.CHECKPOINT if self.checkpoint else ExitCode.FAILED


def capture(exc: BaseException, stage: Stage, step: int) -> CapturedFailure:
    """Reduce ``exc`` to strings and clear its frames, so the tensors they hold can be freed."""
    try:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    except MemoryError:
        text = "(traceback not formatted: out of memory)"
    failure = CapturedFailure(
        exception_type=type(exc).__name__,
        message=str(exc),
        traceback=text,
        stage=stage,
        step=step,
        oom=is_oom(exc),
        config=is_config_error(exc),
        checkpoint=is_checkpoint_error(exc),
        disk_full=is_disk_full(exc),
    )
    for item in exception_chain(exc):
        if item.__traceback__ is not None:
            traceback.clear_frames(item.__traceback__)
        item.__traceback__ = None
    return failure


def write_report(
    path: str,
    failure: CapturedFailure,
    *,
    device: str,
    memory_stats: dict[str, Any] | None = None,
    emergency: tuple[str, int] | None = None,
    expandable_segments_active: bool | None = None,
    resume_checkpoint: str | None = None,
    disk: dict[str, Any] | None = None,
    place: RankPlace = SINGLE,
) -> ErrorReport:
    """Write the report; ``resume_checkpoint`` (the attempt's source, never a scratch copy) is
    named as damaged when the failure is a checkpoint that did not load."""
    report = ErrorReport(
        exit_code=int(failure.exit_code),
        exception_type=failure.exception_type,
        message=failure.message,
        traceback=failure.traceback,
        stage=failure.stage,
        step=failure.step,
        is_oom=failure.oom,
        config_error=failure.config,
        oom_numbers=OomNumbers.from_json(oom_numbers(failure.message) if failure.oom else {}),
        memory_stats=memory_stats,
        device=device,
        emergency_checkpoint=emergency[0] if emergency else None,
        emergency_step=emergency[1] if emergency else None,
        expandable_segments_active=expandable_segments_active,
        damaged_checkpoint=resume_checkpoint if failure.exit_code is ExitCode.CHECKPOINT else None,
        disk_full=failure.disk_full,
        disk=disk,
        allocator=failure.allocator,
        memory_snapshot=failure.memory_snapshot,
        batch=failure.batch,
        time=failure.time,
        rank=place.rank,
        local_rank=place.local_rank,
        world_size=place.world_size,
    )
    write_text_atomic(path, report.to_json())
    return report
