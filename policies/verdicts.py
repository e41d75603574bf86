"""The values the decision reads and returns: past attempts, settings, ``Restart | Wait | GiveUp``."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from qlora_supervise.policies import memory_model
from qlora_supervise.policies.rungs import Survives
from qlora_supervise.policies.search.budget import HostBudget
from qlora_supervise.policies.search.throughput import SpeedObservation
from qlora_supervise.trainer_child.contract.attempt_facts import SampleLengths
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage
from qlora_supervise.trainer_child.contract.spec import Knobs


class FailureLike(Protocol):
    """What the policy reads of a classified failure (the supervisor's ``Failure``)."""

    @property
    def kind(self) -> FailureKind: ...
    @property
    def stage(self) -> Stage: ...
    @property
    def numbers(self) -> Mapping[str, Any]: ...
    @property
    def fatal_xid(self) -> int | None:
        """The fatal NVML Xid that decided a ``gpu_fault``; None otherwise."""


@dataclass(frozen=True)
class PastAttempt:
    """One finished attempt as the policy sees it."""

    knobs: Knobs
    kind: FailureKind | None  # None: the attempt did not fail (stopped by the user)
    steps_progressed: int
    peak_bytes: int | None = None
    stage: Stage | None = None  # where it failed (None: not recorded)
    reached: int = 0  # the last optimizer step it finished (its journal's steps_completed)
    rung: str | None = None  # the decision taken after it (its journal's decision.rung; None: none)
    unapplied: tuple[str, ...] = ()  # knobs it changed that the trainer did not take


@dataclass(frozen=True)
class Settings:
    """The job's supervise section, plus facts the policy needs about the model and budget."""

    max_attempts: int = 8
    max_no_progress: int = 3
    degrade_on_contention: bool = False
    contention_wait_s: float = 1800.0
    disk_wait_s: float = 1800.0
    fallbacks: tuple[str, ...] = ()
    overrides: Mapping[FailureKind, tuple[str, ...]] = field(default_factory=dict)
    budget_bytes: int | None = None
    shape: memory_model.ModelShape | None = None
    unmodelled: str | None = None  # why ``shape`` is None for a model whose config reads (a tool's)
    prior: tuple[memory_model.Observation, ...] = ()  # this host's peaks of the shape (the store)
    sample_lengths: SampleLengths | None = None  # the latest attempt's (what shorten_seq_len cuts)
    speeds: tuple[SpeedObservation, ...] = ()  # this host's tokens/s of the shape, then this run's
    fallback_shapes: tuple[tuple[str, memory_model.ModelShape | None], ...] = ()  # as ``fallbacks``
    speed_trial: bool = True  # attempt 1 times its top candidates before step 1
    cannot_take: frozenset[str] = frozenset()  # rungs the trainer cannot be told
    host: HostBudget | None = None  # the host budget every config must fit too (None: none)
    targets: tuple[str, ...] | str = memory_model.DEFAULT_TARGETS  # ``train.target_modules``
    step_up: bool = True  # step back up once a rung's cause has cleared (ladder/step_up.py)
    step_up_settle_s: float = 120.0  # how long a change on the card must hold to step up or re-time
    step_up_quality: bool = False  # a step-up may undo a quality rung too


def for_model(settings: Settings, model: str) -> Settings:
    """The settings for ``model``: a fallback's own shape without the job's model's measurements."""
    shapes = dict(settings.fallback_shapes)
    if model not in shapes:
        return settings
    return dataclasses.replace(settings, shape=shapes[model], prior=(), speeds=())


@dataclass(frozen=True)
class Restart:
    knobs: Knobs
    rung: str  # "+"-joined when the memory model made the policy apply several at once
    changes: Mapping[str, tuple[Any, Any]]
    why: str
    survives: Survives


class WaitFor(str, enum.Enum):
    """What a :class:`Wait` waits for."""

    GPU_MEMORY = "gpu_memory"  # other processes to release the card's memory
    DISK = "disk"  # room on the disk that holds the run directory


@dataclass(frozen=True)
class Wait:
    """Wait up to ``seconds`` for ``needed_bytes`` of GPU memory (or disk) to be free, then ask again."""

    seconds: float
    needed_bytes: int
    why: str
    resource: WaitFor = WaitFor.GPU_MEMORY


@dataclass(frozen=True)
class WaitResult:
    """What the loop saw while carrying out a :class:`Wait`: the last free reading (None: no reading)."""

    free_bytes: int | None
    waited_s: float
    stopped: bool = False  # a stop signal ended the wait: no verdict (the loop stops the run)


@dataclass(frozen=True)
class GiveUp:
    why: str
    retryable: bool = True  # False: no config change can help (exit 4 rather than 3)


Decision = Restart | Wait | GiveUp
