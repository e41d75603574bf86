"""What went wrong: an exception reduced to a :class:`CapturedFailure` of strings (so it, and the
activations its frames hold, can be dropped before memory is needed again), its exit code and OOM numbers."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
import traceback

from qlora_supervise.trainer_child.contract import attempt_facts, checkpoints, oom_message
from qlora_supervise.trainer_child.contract.allocator import AllocatorFacts
from qlora_supervise.trainer_child.contract.codes import ExitCode, Stage
from qlora_supervise.trainer_child.contract.disk_space import exception_chain, is_disk_full

OOM_MARKERS = (
    "out of memory",  # CUDA's and cudaMallocAsync's wordings among them
    "DefaultCPUAllocator: can't allocate memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "Cannot allocate memory",
)
_CPU_TRIED = re.compile(r"you tried to allocate (\d+) bytes")


class ConfigError(Exception):
    """The job cannot work as written (model, data, fields, target_modules, caps): never retried."""


def is_oom(exc: BaseException) -> bool:
    import torch

    return _in_chain(exc, (torch.OutOfMemoryError, MemoryError)) or any(
        marker in str(item) for item in exception_chain(exc) for marker in OOM_MARKERS
    )


def _in_chain(exc: BaseException, kinds: type[BaseException] | tuple[type[BaseException], ...]) -> bool:
    return any(isinstance(item, kinds) for item in exception_chain(exc))


#: Exceptions of a trainer's setup and load that say the same on every start (a missing key or path,
#: a value its parser refuses, a package it cannot import): a config error. A RuntimeError or an
#: OSError of the device or the disk is left to the classifier.
_DETERMINISTIC = (ValueError, TypeError, KeyError, AttributeError, ImportError, NotImplementedError,
                  FileNotFoundError, NotADirectoryError, IsADirectoryError, SyntaxError)  # fmt: skip
#: Deterministic by name: huggingface_hub's offline refusal (a ConnectionError); safetensors' damaged file.
_DETERMINISTIC_NAMES = frozenset({"OfflineModeIsEnabled", "SafetensorError", "HeaderTooLarge"})
#: Errors of a load short of device memory (bitsandbytes under ``device_map: auto`` on a shared card,
#: a weight left on the meta device): the card's state, not the config's.
_SHORT_OF_MEMORY = ("dispatched on the CPU or the disk", "enough GPU RAM", "meta tensor")


def is_the_configs(exc: BaseException, stage: Stage) -> bool:
    """Whether ``exc``, raised in setup or load, is the config's: it would fail alike on every start."""
    if stage not in (Stage.SETUP, Stage.LOAD):
        return False
    chain = exception_chain(exc)
    if any(words in str(item) for item in chain for words in _SHORT_OF_MEMORY):
        return False
    return isinstance(exc, _DETERMINISTIC) or any(
        type(item).__name__ in _DETERMINISTIC_NAMES or "OfflineModeIsEnabled" in str(item) for item in chain
    )


def oom_numbers(message: str) -> dict[str, int]:
    """Numbers of an OOM message (``oom_message``'s parser, and the CPU allocator's ``tried to allocate``)."""
    numbers: dict[str, int] = {}
    with contextlib.suppress(Exception):  # a parser bug: the report matters more
        numbers.update(oom_message.parse_numbers(message))
    match = _CPU_TRIED.search(message)
    if match and "tried_to_allocate" not in numbers:
        numbers["tried_to_allocate"] = int(match.group(1))
    return numbers


@dataclasses.dataclass
class CapturedFailure:
    exception_type: str
    message: str
    traceback: str
    stage: Stage
    step: int
    oom: bool
    config: bool
    checkpoint: bool = False  # the resume checkpoint did not load (an OOM while loading is an OOM)
    disk_full: bool = False  # ENOSPC / EROFS / EDQUOT (see disk_space): wait for room, not a rung
    allocator: AllocatorFacts | None = None
    memory_snapshot: str | None = None
    batch: attempt_facts.BatchInFlight | None = None  # the micro-batch a training step's OOM happened on
    time: float = dataclasses.field(default_factory=time.time)  # when the exception was caught

    @property
    def device_oom(self) -> bool:
        """An accelerator's allocator ran out (torch.OutOfMemoryError), not the host's."""
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
        config=_in_chain(exc, ConfigError),
        checkpoint=_in_chain(exc, checkpoints.CheckpointLoadError),
        disk_full=is_disk_full(exc),
    )
    # An OOM, a damaged checkpoint or a full disk keep their own verdicts.
    if not (failure.oom or failure.checkpoint or failure.disk_full):
        failure.config = failure.config or is_the_configs(exc, stage)
    for item in exception_chain(exc):
        if item.__traceback__ is not None:
            traceback.clear_frames(item.__traceback__)
        item.__traceback__ = None
    return failure
