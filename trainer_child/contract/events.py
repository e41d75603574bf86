"""The child's events file: one JSON object per line, read back into one typed record each.

The child writes each line with :func:`event_line` (``{"event": name, "time": ..., **fields}``);
the supervisor reads it with :func:`parse_event`, once, through one pydantic union keyed on the
line's ``event`` (:data:`ChildEvent`), into the frozen records below, and never indexes the line
as a dict again. A new event is a record with an ``event`` name and one entry in :data:`_RECORDS`.

A line that is not a JSON object, names no event this version knows, or does not fit its record
(a torn last line after a kill, a wrong type) gives None: skipped, never trusted.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import operator
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, TypeAlias

from pydantic import BeforeValidator, Discriminator, StrictInt, Tag, TypeAdapter, ValidationError

from qlora_supervise.trainer_child.contract.attempt_facts import RankReduction, SampleLengths
from qlora_supervise.trainer_child.contract.codes import StageName
from qlora_supervise.trainer_child.contract.memory_numbers import MemoryNumbers
from qlora_supervise.trainer_child.contract.script_knobs import KnobSetting
from qlora_supervise.trainer_child.contract.speed_trial import SpeedTrialEvent


def event_line(event: str, **fields: Any) -> str:
    """One line of the child's events file."""
    return json.dumps({"event": event, "time": time.time(), **fields}, default=str) + "\n"


@functools.cache
def _adapter(record: type[Any]) -> TypeAdapter[Any]:
    return TypeAdapter(record)


@dataclasses.dataclass(frozen=True)
class PlainEvent:
    """An event record: a frozen dataclass with a ``ClassVar`` ``event`` name whose fields are the
    line's keys. ``time`` is the line's stamp, set by :func:`event_line` (None in a record built to
    be written), left out of ``fields()`` and of comparisons: it is not part of what the event says."""

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
    """One ``heartbeat`` event: where the child is, how fast it goes, and its memory.

    ``step`` is the last completed optimizer step; the supervisor decides hangs from ``step``
    and ``stage`` not changing, so a beat is sent whatever the main thread does.
    """

    event: ClassVar[str] = "heartbeat"
    stage: StageName
    step: StrictInt  # a step of ``"3"`` or ``true`` is no step to trust
    loss: float | None = None
    tokens_per_s: float | None = None
    memory: MemoryNumbers = dataclasses.field(default_factory=MemoryNumbers)


@dataclasses.dataclass(frozen=True)
class Started(PlainEvent):
    """``started``: the process, its place under torchrun, its device and library versions.

    ``vmdata`` / ``rss``: bytes at start. A stand-in child (the tests' scripted one) may also
    name ``max_steps`` and where it starts (``step``, ``stage``).
    """

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
        # The stand-in's keys are written where it gave them; the child's own line has none.
        stand_in = ("max_steps", "step", "stage")
        return {k: v for k, v in super().fields().items() if k not in stand_in or v is not None}


@dataclasses.dataclass(frozen=True)
class StageEntered(PlainEvent):
    """``stage``: the child entered a phase (load, training, eval, save) at ``step``."""

    event: ClassVar[str] = "stage"
    stage: StageName | None = None
    step: int | None = None


@dataclasses.dataclass(frozen=True)
class Loaded(PlainEvent):
    """``loaded``: the model is loaded: its parameters, the data's rows, memory and sample lengths."""

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
    """``checkpoint_saved``: a complete checkpoint at ``path``; ``emergency``: after a failure;
    ``early``: asked for by ``EARLY_CHECKPOINT_SIGNAL``."""

    event: ClassVar[str] = "checkpoint_saved"
    step: int | None = None
    path: str | None = None
    emergency: bool | None = None
    early: bool | None = None


@dataclasses.dataclass(frozen=True)
class EarlyCheckpointRequested(PlainEvent):
    """``early_checkpoint_requested``: the signal arrived; a checkpoint follows this step."""

    event: ClassVar[str] = "early_checkpoint_requested"
    stage: StageName | None = None
    step: int | None = None


@dataclasses.dataclass(frozen=True)
class Resumed(PlainEvent):
    """``resumed``: training continues from ``path`` at ``from_step``; ``reset_optimizer`` (and
    why) when the optimizer state was not restored; ``rank_reduction`` when the adapter was cut."""

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
    """``finished``: training ended at ``step`` with the adapter written, or the merge (``step``
    None) wrote ``merged`` in ``seconds`` on ``device``."""

    event: ClassVar[str] = "finished"
    step: int | None = None
    adapter: str | None = None
    merged: str | None = None
    seconds: float | None = None
    device: str | None = None

    def fields(self) -> dict[str, Any]:
        # A training child writes step and adapter; the merge writes step, merged, seconds, device.
        merge = {"merged": self.merged, "seconds": self.seconds, "device": self.device}
        train = {"adapter": self.adapter}
        return {"step": self.step, **(merge if self.merged is not None else train)}


@dataclasses.dataclass(frozen=True)
class Stopping(PlainEvent):
    """``stopping``: a graceful stop was asked for; the child checkpoints and exits."""

    event: ClassVar[str] = "stopping"
    stage: StageName | None = None
    step: int | None = None


@dataclasses.dataclass(frozen=True)
class MergePlanned(PlainEvent):
    """``merge_plan``: the merge's memory plan (bytes): the device, what each would need, what was free."""

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
class ScriptKnobs(PlainEvent):
    """``script_knobs``: what a script with its settings in its code built, and what the shim
    changed there (``contract/script_knobs.py``); the model's ``config.json`` values it loaded."""

    event: ClassVar[str] = "script_knobs"
    settings: tuple[KnobSetting, ...] = ()
    model_config: Mapping[str, Any] | None = None
    complete: bool = False  # written at train(): the script has built all it builds


#: The records of the events file, each under its ``event`` name: a new event plugs in here.
_RECORDS: tuple[type[Any], ...] = (
    Started,
    StageEntered,
    Loaded,
    TrainerReady,
    Heartbeat,
    CheckpointSaved,
    EarlyCheckpointRequested,
    Resumed,
    Finished,
    Stopping,
    MergePlanned,
    SpeedTrialEvent,
    ScriptKnobs,
)
EVENT_NAMES = frozenset(record.event for record in _RECORDS)

#: Every event of the child's events file.
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


def _name(raw: object) -> str | None:
    name = raw.get("event") if isinstance(raw, Mapping) else getattr(raw, "event", None)
    return name if isinstance(name, str) and name in EVENT_NAMES else None


def _memory_in_line(raw: object) -> object:
    """The line's flat memory keys as the record's ``memory``."""
    return {**raw, "memory": raw} if isinstance(raw, Mapping) else raw


def _tagged(record: type[Any]) -> Any:
    if record in (Heartbeat, Loaded):
        return Annotated[record, BeforeValidator(_memory_in_line), Tag(record.event)]
    return Annotated[record, Tag(record.event)]


_UNION: Any = Annotated[functools.reduce(operator.or_, map(_tagged, _RECORDS)), Discriminator(_name)]
_LINE: TypeAdapter[ChildEvent] = TypeAdapter(_UNION)


def parse_event(line: str) -> ChildEvent | None:
    """The record of one line of the events file; None for a blank, torn or corrupt line, or an
    event this version does not know. Never raises: a child's bad line must not stop the supervisor."""
    if not line.strip():
        return None
    try:
        return _LINE.validate_json(line)
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
    found = [e for e in events if isinstance(e, ScriptKnobs)]
    return found[-1].settings if found else ()


def event_from_fields(raw: Mapping[str, Any]) -> ChildEvent | None:
    """The record of an already decoded line (:func:`parse_event` without the JSON)."""
    try:
        return _LINE.validate_python(raw)
    except (ValidationError, ValueError, RecursionError):
        return None
