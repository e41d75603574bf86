"""What went wrong: an exception reduced to a :class:`CapturedFailure` of strings (so that it, and
the activations its frames keep alive, can be dropped before memory is needed again), its exit
code and OOM numbers."""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
import traceback

from qlora_supervise.trainer_child.contract.allocator import AllocatorFacts
from qlora_supervise.trainer_child.contract.attempt_facts import BatchInFlight
from qlora_supervise.trainer_child.contract.checkpoints import CheckpointLoadError
from qlora_supervise.trainer_child.contract.codes import ExitCode, Stage
from qlora_supervise.trainer_child.contract.disk_space import exception_chain, is_disk_full
from qlora_supervise.trainer_child.contract.oom_message import parse_numbers

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


#: Exceptions a trainer raises while it reads its config and loads its model and data that say the
#: same thing on every start (a missing dataset key, a path that is not there, a value its parser
#: refuses, a package it cannot import, the hub while offline): a config error, not retried
#: unchanged. A RuntimeError or an OSError of the device or the disk is left to the classifier.
_DETERMINISTIC = (ValueError, TypeError, KeyError, AttributeError, ImportError, NotImplementedError,
                  FileNotFoundError, NotADirectoryError, IsADirectoryError, SyntaxError)  # fmt: skip
#: Deterministic by name, from libraries not imported here: huggingface_hub's offline refusal (a
#: ConnectionError by class; offline, it is the config's), and safetensors' refusal of a model
#: file whose header does not load (the file is damaged or cut short: re-download it).
_DETERMINISTIC_NAMES = frozenset({"OfflineModeIsEnabled", "SafetensorError", "HeaderTooLarge"})
#: ValueErrors and NotImplementedErrors of a load that did not get the device memory it wanted
#: (transformers' bitsandbytes quantizer under ``device_map: auto`` on a shared card, a weight
#: left on the meta device): the card's state, not the config's, so the classifier decides.
_SHORT_OF_MEMORY = ("dispatched on the CPU or the disk", "enough GPU RAM", "meta tensor")
#: Before the first step: the trainer is still reading its config and loading (issue 29 item 5).
_BEFORE_TRAINING = frozenset({Stage.SETUP, Stage.LOAD})


def is_the_configs(exc: BaseException, stage: Stage) -> bool:
    """Whether ``exc``, raised while the trainer set up or loaded (``stage``), is the config's: it
    would fail alike on every start (a value the tool's parser refuses, ``learning_rate: [1, 2]``
    at its optimizer's construction, a model file that does not load)."""
    if stage not in _BEFORE_TRAINING:
        return False
    chain = exception_chain(exc)
    if any(words in str(item) for item in chain for words in _SHORT_OF_MEMORY):
        return False
    if isinstance(exc, _DETERMINISTIC):
        return True
    return any(
        type(item).__name__ in _DETERMINISTIC_NAMES or "OfflineModeIsEnabled" in str(item) for item in chain
    )


def oom_numbers(message: str) -> dict[str, int]:
    """Numbers of an OOM message; the parser lives in ``oom_message`` (written separately),
    the CPU allocator's ``you tried to allocate N bytes`` is read here in any case."""
    numbers: dict[str, int] = {}
    with contextlib.suppress(Exception):  # a parser bug: the report matters more
        numbers.update(parse_numbers(message))
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
    """Reduce ``exc`` to strings and clear its frames, so the tensors they hold can be freed.

    The config's when it says so (:class:`ConfigError`) or when it is a refusal before the first
    step (:func:`is_the_configs`): our child and a foreign tool's shim alike."""
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
        checkpoint=_in_chain(exc, CheckpointLoadError),
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
