"""The child's events file: one JSON object per line, read back into one typed record each.

The child writes each line with :func:`event_line` (``{"event": name, "time": ..., **fields}``);
the supervisor reads it with :func:`parse_event`, once, into one of the frozen records of
:data:`ChildEvent`, and never indexes the line as a dict again. :data:`PARSERS` is the one
registry of event names: a new event is a record with ``event``, ``fields()`` and a parser, and
one entry there.

Every record reads the lines of older children too: a field a line lacks, or holds with the wrong
type, is None (the heartbeat alone needs an integer ``step``); memory fields read the older keys
of :meth:`MemoryNumbers.from_fields`. Only a line that is not a JSON object, names no known
event, or is a heartbeat without a step, gives None.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

from qlora_supervise.trainer_child.contract._event_fields import (
    PlainEvent,
    float_or_none,
    int_or_none,
)
from qlora_supervise.trainer_child.contract._event_fields import (
    event_line as event_line,  # the writer keeps its name: ``events.event_line``
)
from qlora_supervise.trainer_child.contract.attempt_facts import RankReduction, SampleLengths
from qlora_supervise.trainer_child.contract.codes import Stage
from qlora_supervise.trainer_child.contract.memory_numbers import MemoryNumbers
from qlora_supervise.trainer_child.contract.speed_trial import SpeedTrialEvent

#: Every record's ``time``: the line's stamp, not part of what the event says (records compare without it).
_STAMP: Any = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """One ``heartbeat`` event: where the child is, how fast it goes, and its memory.

    ``step`` is the last completed optimizer step; the supervisor decides hangs from ``step``
    and ``stage`` not changing, so a beat is sent whatever the main thread does. ``time``: the
    line's stamp (None in a beat built to be written).
    """

    event: ClassVar[str] = "heartbeat"
    stage: Stage
    step: int
    loss: float | None = None
    tokens_per_s: float | None = None
    memory: MemoryNumbers = dataclasses.field(default_factory=MemoryNumbers)
    time: float | None = _STAMP

    def fields(self) -> dict[str, Any]:
        """The fields of the event line, flat: ``stage``, ``step``, ``loss``, ``tokens_per_s``
        and those of :meth:`MemoryNumbers.fields`."""
        return {
            "stage": self.stage.value,
            "step": self.step,
            "loss": self.loss,
            "tokens_per_s": self.tokens_per_s,
            **self.memory.fields(),
        }

    def to_line(self) -> str:
        return event_line(self.event, **self.fields())

    @classmethod
    def from_fields(cls, raw: Mapping[str, Any]) -> Heartbeat | None:
        """The heartbeat in a parsed event line (today's keys or older ones); None when the
        line has no integer step (not a heartbeat this reader can trust)."""
        step = int_or_none(raw.get("step"))
        if step is None:
            return None
        return cls(
            stage=Stage.named(raw.get("stage")),
            step=step,
            loss=float_or_none(raw.get("loss")),
            tokens_per_s=float_or_none(raw.get("tokens_per_s")),
            memory=MemoryNumbers.from_fields(raw),
            time=float_or_none(raw.get("time")),
        )


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
    stage: Stage | None = None
    time: float | None = _STAMP

    def fields(self) -> dict[str, Any]:
        # The stand-in's keys are written where it gave them; the child's own line has none.
        stand_in = ("max_steps", "step", "stage")
        return {k: v for k, v in super().fields().items() if k not in stand_in or v is not None}


@dataclasses.dataclass(frozen=True)
class StageEntered(PlainEvent):
    """``stage``: the child entered a phase (load, training, eval, save) at ``step``."""

    event: ClassVar[str] = "stage"
    stage: Stage | None = None
    step: int | None = None
    time: float | None = _STAMP


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
    time: float | None = _STAMP

    @classmethod
    def _nested(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        return {"memory": MemoryNumbers.from_fields(raw), "sample_lengths": SampleLengths.from_fields(raw)}

    def fields(self) -> dict[str, Any]:
        lengths = self.sample_lengths.fields() if self.sample_lengths is not None else {}
        return {**super().fields(), **self.memory.fields(), **lengths}


@dataclasses.dataclass(frozen=True)
class TrainerReady(PlainEvent):
    """``trainer_ready``: seconds per start-up phase (``phases_s``); ``prepared``: a spare did them."""

    event: ClassVar[str] = "trainer_ready"
    phases_s: Mapping[str, Any] | None = None
    prepared: bool | None = None
    prepared_s: float | None = None
    time: float | None = _STAMP


@dataclasses.dataclass(frozen=True)
class CheckpointSaved(PlainEvent):
    """``checkpoint_saved``: a complete checkpoint at ``path``; ``emergency``: after a failure;
    ``early``: asked for by ``EARLY_CHECKPOINT_SIGNAL``."""

    event: ClassVar[str] = "checkpoint_saved"
    step: int | None = None
    path: str | None = None
    emergency: bool | None = None
    early: bool | None = None
    time: float | None = _STAMP


@dataclasses.dataclass(frozen=True)
class EarlyCheckpointRequested(PlainEvent):
    """``early_checkpoint_requested``: the signal arrived; a checkpoint follows this step."""

    event: ClassVar[str] = "early_checkpoint_requested"
    stage: Stage | None = None
    step: int | None = None
    time: float | None = _STAMP


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
    time: float | None = _STAMP

    @classmethod
    def _nested(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        return {"rank_reduction": RankReduction.from_fields(raw)}

    def fields(self) -> dict[str, Any]:
        cut = self.rank_reduction.fields() if self.rank_reduction is not None else {}
        return {**super().fields(), **cut}


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
    time: float | None = _STAMP

    def fields(self) -> dict[str, Any]:
        # A training child writes step and adapter; the merge writes step, merged, seconds, device.
        merge = {"merged": self.merged, "seconds": self.seconds, "device": self.device}
        train = {"adapter": self.adapter}
        return {"step": self.step, **(merge if self.merged is not None else train)}


@dataclasses.dataclass(frozen=True)
class Stopping(PlainEvent):
    """``stopping``: a graceful stop was asked for; the child checkpoints and exits."""

    event: ClassVar[str] = "stopping"
    stage: Stage | None = None
    step: int | None = None
    time: float | None = _STAMP


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
    time: float | None = _STAMP


#: Every event of the child's events file.
ChildEvent = (
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
)

#: The one registry: each event name and the parser of its (decoded) line. A new event plugs in here.
PARSERS: Mapping[str, Callable[[Mapping[str, Any]], ChildEvent | None]] = {
    Started.event: Started.from_fields,
    StageEntered.event: StageEntered.from_fields,
    Loaded.event: Loaded.from_fields,
    TrainerReady.event: TrainerReady.from_fields,
    Heartbeat.event: Heartbeat.from_fields,
    CheckpointSaved.event: CheckpointSaved.from_fields,
    EarlyCheckpointRequested.event: EarlyCheckpointRequested.from_fields,
    Resumed.event: Resumed.from_fields,
    Finished.event: Finished.from_fields,
    Stopping.event: Stopping.from_fields,
    MergePlanned.event: MergePlanned.from_fields,
    SpeedTrialEvent.event: SpeedTrialEvent.from_json,
}

EVENT_NAMES = frozenset(PARSERS)


def parse_event(line: str) -> ChildEvent | None:
    """The record of one line of the events file; None for a blank, torn or corrupt line, or an
    event this version does not know. Never raises: a child's bad line must not stop the supervisor."""
    if not line.strip():
        return None
    try:
        raw = json.loads(line)
    except (ValueError, RecursionError):
        return None
    return event_from_fields(raw) if isinstance(raw, Mapping) else None


def event_from_fields(raw: Mapping[str, Any]) -> ChildEvent | None:
    """The record of an already decoded line (:func:`parse_event` without the JSON)."""
    name = raw.get("event")
    parser = PARSERS.get(name) if isinstance(name, str) else None
    if parser is None:
        return None
    try:
        return parser(raw)
    except (TypeError, ValueError, OverflowError):  # a value no reader expected (a newer child's)
        return None
