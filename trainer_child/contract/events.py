"""The child's events file: one JSON object per line (:func:`event_line`), read back once by
:func:`parse_event` through one pydantic union keyed on ``event`` (:data:`ChildEvent`) into the frozen
records below. A new event is a record with an ``event`` name and one entry in the union."""

from __future__ import annotations

import dataclasses
import enum
import functools
import json
import operator
import time
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeAlias

from pydantic import BeforeValidator, Discriminator, StrictInt, Tag, TypeAdapter, ValidationError

from qlora_supervise.trainer_child.contract.attempt_facts import RankReduction, SampleLengths
from qlora_supervise.trainer_child.contract.codes import StageName
from qlora_supervise.trainer_child.contract.script_knobs import KnobSetting
from qlora_supervise.trainer_child.contract.spec import TrialCandidate


class ChildPeakSource(str, enum.Enum):
    """What :attr:`MemoryNumbers.peak_bytes` measured: the memory its cap limits, tried in this order."""

    CUDA_ALLOCATOR = "cuda_allocator"  # torch.cuda.max_memory_allocated on the training GPU
    DATA_SEGMENT = "data_segment"  # peak VmData on the CPU: what RLIMIT_DATA (cpu_memory_limit) caps
    RSS = "rss"  # VmHWM, where the data segment cannot be read


@dataclasses.dataclass(frozen=True)
class MemoryNumbers:
    """The child's memory at one moment, in bytes (None: not read); ``peak_bytes`` is the attempt's
    one peak so far (:meth:`measured`), never re-derived by readers."""

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
        """The peak rule: the first nonzero of the CUDA allocator's, the data segment's and VmHWM."""
        peaks = zip((cuda_peak, data_segment_peak, rss_high_water), ChildPeakSource, strict=True)
        peak, source = next(((value, kind) for value, kind in peaks if value), (None, None))
        return cls(peak, source, allocated, reserved, rss, rss_high_water, vmdata)

    def fields(self) -> dict[str, Any]:
        """The JSON fields of an event line (flat, so ``jq .peak_bytes`` reads them)."""
        return dict(_MEMORY.dump_python(self, mode="json"))

    @classmethod
    def from_fields(cls, raw: Mapping[str, Any]) -> MemoryNumbers:
        """The memory fields of an event line read flat (extra keys ignored)."""
        return _MEMORY.validate_python(raw)


_MEMORY = TypeAdapter(MemoryNumbers)
_adapter = functools.cache(TypeAdapter)


def event_line(event: str, **fields: Any) -> str:
    """One line of the child's events file."""
    return json.dumps({"event": event, "time": time.time(), **fields}, default=str) + "\n"


@dataclasses.dataclass(frozen=True)
class PlainEvent:
    """An event record, its fields the line's keys; ``time`` (the line's stamp) is not compared."""

    event: ClassVar[str]
    time: float | None = dataclasses.field(default=None, compare=False, kw_only=True)

    def fields(self) -> dict[str, Any]:
        raw: dict[str, Any] = _adapter(type(self)).dump_python(self, mode="json")  # type: ignore[arg-type]
        del raw["time"]
        memory = raw.pop("memory", None)  # written flat, so ``jq .peak_bytes`` reads it
        return {**raw, **(memory or {})}

    def to_line(self) -> str:
        return event_line(self.event, **self.fields())


@dataclasses.dataclass(frozen=True)
class Heartbeat(PlainEvent):
    """``heartbeat``: the stage, the last completed step (a hang: both unchanged), speed and memory."""

    event: ClassVar[str] = "heartbeat"
    stage: StageName
    step: StrictInt  # a step of ``"3"`` or ``true`` is no step to trust
    loss: float | None = None
    tokens_per_s: float | None = None
    memory: MemoryNumbers = dataclasses.field(default_factory=MemoryNumbers)


@dataclasses.dataclass(frozen=True)
class Started(PlainEvent):
    """``started``: the process, its rank, device and versions; a stand-in child may add the rest."""

    event: ClassVar[str] = "started"
    pid: int | None = None
    attempt: int | None = None
    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    device: str | None = None
    device_name: str | None = None
    versions: Mapping[str, Any] | None = None
    vmdata: int | None = None
    rss: int | None = None
    cpu_memory_limit: int | None = None
    gpu_memory_limit: int | None = None
    expandable_segments_active: bool | None = None
    cpu_fallback: str | None = None  # why a job that asked for a GPU runs on the CPU
    trust_remote_code: bool | None = None
    max_steps: int | None = None
    step: int | None = None
    stage: StageName | None = None

    def fields(self) -> dict[str, Any]:
        stand_in = ("max_steps", "step", "stage")
        return {k: v for k, v in super().fields().items() if k not in stand_in or v is not None}


@dataclasses.dataclass(frozen=True)
class AtStage(PlainEvent):
    """An event that says no more than where the child is."""

    stage: StageName | None = None
    step: int | None = None


@dataclasses.dataclass(frozen=True)
class StageEntered(AtStage):
    """``stage``: the child entered a phase (load, training, eval, save) at ``step``."""

    event: ClassVar[str] = "stage"


@dataclasses.dataclass(frozen=True)
class Loaded(PlainEvent):
    """``loaded``: the model's parameters, the data's rows, memory and sample lengths."""

    event: ClassVar[str] = "loaded"
    trainable_params: int | None = None
    total_params: int | None = None
    trainable_share: float | None = None
    linear4bit: int | None = None
    dtype: str | None = None
    attn_implementation: str | None = None  # eager / sdpa / flash_attention_2: transformers' choice
    train_rows: int | None = None
    eval_rows: int | None = None
    memory: MemoryNumbers = dataclasses.field(default_factory=MemoryNumbers)
    sample_lengths: SampleLengths | None = None


@dataclasses.dataclass(frozen=True)
class TrainerReady(PlainEvent):
    """``trainer_ready``: seconds per start-up phase (``phases_s``); ``prepared``: a spare did them."""

    event: ClassVar[str] = "trainer_ready"
    phases_s: Mapping[str, Any] | None = None
    prepared: bool | None = None
    prepared_s: float | None = None


@dataclasses.dataclass(frozen=True)
class CheckpointSaved(PlainEvent):
    """``checkpoint_saved``: a complete checkpoint, after a failure (``emergency``) or asked (``early``)."""

    event: ClassVar[str] = "checkpoint_saved"
    step: int | None = None
    path: str | None = None
    emergency: bool | None = None
    early: bool | None = None


@dataclasses.dataclass(frozen=True)
class EarlyCheckpointRequested(AtStage):
    """``early_checkpoint_requested``: the signal arrived; a checkpoint follows this step."""

    event: ClassVar[str] = "early_checkpoint_requested"


@dataclasses.dataclass(frozen=True)
class Resumed(PlainEvent):
    """``resumed``: training continues from ``path`` at ``from_step``."""

    event: ClassVar[str] = "resumed"
    from_step: int | None = None
    path: str | None = None
    reset_optimizer: bool | None = None
    reset_reason: str | None = None
    learning_rate: float | None = None
    micro_batch_size: int | None = None
    grad_accum: int | None = None
    rank_reduction: RankReduction | None = None


@dataclasses.dataclass(frozen=True)
class Finished(PlainEvent):
    """``finished``: training wrote ``adapter`` at ``step``, or the merge (``step`` None) ``merged``."""

    event: ClassVar[str] = "finished"
    step: int | None = None
    adapter: str | None = None
    merged: str | None = None
    seconds: float | None = None
    device: str | None = None

    def fields(self) -> dict[str, Any]:
        merge = {"merged": self.merged, "seconds": self.seconds, "device": self.device}
        return {"step": self.step, **(merge if self.merged is not None else {"adapter": self.adapter})}


@dataclasses.dataclass(frozen=True)
class Stopping(AtStage):
    """``stopping``: a graceful stop was asked for; the child checkpoints and exits."""

    event: ClassVar[str] = "stopping"


@dataclasses.dataclass(frozen=True)
class MergePlanned(PlainEvent):
    """``merge_plan``: the merge's device and memory plan (bytes)."""

    event: ClassVar[str] = "merge_plan"
    device: str | None = None
    gpu_need_bytes: int | None = None
    host_need_gpu_bytes: int | None = None
    host_need_cpu_bytes: int | None = None
    gpu_free_bytes: int | None = None
    host_available_bytes: int | None = None
    why: str | None = None
    dtype: str | None = None


@dataclasses.dataclass(frozen=True)
class TrialResult:
    """A candidate's tokens/s and peaks (``host_peak_bytes``: VmHWM), or the OOM that dropped it."""

    candidate: TrialCandidate
    tokens_per_s: float | None
    peak_bytes: int | None
    seconds: float
    error: str | None = None
    host_peak_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class SpeedTrialEvent(PlainEvent):
    """``speed_trial``: each candidate's result, the first the planned config."""

    event: ClassVar[str] = "speed_trial"
    results: tuple[TrialResult, ...]
    seconds: float  # the trial's whole cost, before step 1
    abandoned: str | None = None  # why a foreign tool's trial kept the plan (shim/session.py); None: it ran


@dataclasses.dataclass(frozen=True)
class ScriptKnobs(PlainEvent):
    """``script_knobs``: what a script built, what the shim changed, and the model's config."""

    event: ClassVar[str] = "script_knobs"
    settings: tuple[KnobSetting, ...] = ()
    model_config: Mapping[str, Any] | None = None
    complete: bool = False  # written at train(): the script has built all it builds


#: Every event of the child's events file, each under its ``event`` name.
ChildEvent: TypeAlias = (
    Started
    | StageEntered
    | Loaded
    | TrainerReady
    | Heartbeat
    | CheckpointSaved
    | EarlyCheckpointRequested
    | Resumed
    | Finished
    | Stopping
    | MergePlanned
    | SpeedTrialEvent
    | ScriptKnobs
)
_RECORDS: tuple[type[Any], ...] = typing.get_args(ChildEvent)
EVENT_NAMES = frozenset(record.event for record in _RECORDS)


def _name(raw: object) -> str | None:
    name = raw.get("event") if isinstance(raw, Mapping) else getattr(raw, "event", None)
    return name if isinstance(name, str) and name in EVENT_NAMES else None


def _memory_in_line(raw: object) -> object:
    """The line's flat memory keys as the record's ``memory`` (records without one ignore it)."""
    return {**raw, "memory": raw} if isinstance(raw, Mapping) else raw


_TAGGED = (Annotated[record, BeforeValidator(_memory_in_line), Tag(record.event)] for record in _RECORDS)
_UNION: Any = Annotated[functools.reduce(operator.or_, _TAGGED), Discriminator(_name)]
_LINE: TypeAdapter[ChildEvent] = TypeAdapter(_UNION)


def parse_event(line: str | Mapping[str, Any]) -> ChildEvent | None:
    """A line's record (or its decoded fields'); None, never raising, for a torn, ill-typed or unknown one."""
    try:
        return _LINE.validate_json(line) if isinstance(line, str) else _LINE.validate_python(line)
    except (ValidationError, ValueError, RecursionError):
        return None


def read_events(path: Path) -> list[ChildEvent]:
    """Every event of an events file, in order (a missing or unreadable file has none)."""
    try:
        lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError:
        return []
    return [event for event in map(parse_event, lines) if event is not None]


def script_settings(events: list[ChildEvent]) -> tuple[KnobSetting, ...]:
    """What a script built, from the newest ``script_knobs`` event (none: not a script's attempt)."""
    return next((e.settings for e in reversed(events) if isinstance(e, ScriptKnobs)), ())
