"""The one contract between the supervisor and the trainer child.

Standard library only: the supervisor imports this module and must never pull in torch.

The supervisor writes an :class:`AttemptSpec` to ``attempt-NNN/spec.json`` and starts
``python -m qlora_supervise.trainer_child --spec attempt-NNN/spec.json``. The child speaks back
through files, never through log scraping:

* ``spec.events_file``: one JSON object per line (:func:`event_line`), ``"event"`` is one of
  :data:`EVENT_NAMES`; a heartbeat line is a :class:`Heartbeat`.
* ``spec.error_file``: an :class:`ErrorReport`, written atomically, on any failure.
* the exit code, one of the reserved :class:`ExitCode` values.

Under torchrun (``knobs.world_size`` > 1) every rank runs the child with the same spec and writes
its own events and error report, rank N at :func:`rank_file` (``error.rank1.json``,
``child-events.rank1.jsonl``; rank 0 at the paths the spec names); the report says which rank
(``rank``, ``local_rank``, ``world_size``) and when its exception was caught (``time``). Rank 0
alone writes checkpoints and the adapter.

Durable writes, checkpoint names and process checks that both sides share live beside it in
:mod:`.durable`, :mod:`.checkpoint_dirs` and :mod:`.processes`, which are standard library only too.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import signal
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .allocator_facts import AllocatorFacts


class ExitCode(enum.IntEnum):
    """Reserved exit codes of the trainer child (gunicorn-style: they stop restart loops)."""

    OK = 0
    OOM = 70  # memory ran out; the error report says where and with which numbers
    CONFIG = 71  # bad job, model, data or target_modules: never retried
    FAILED = 72  # any other exception; the report has the traceback
    STOPPED = 73  # asked to stop (SIGTERM), checkpointed first: resumable
    CHECKPOINT = 74  # the checkpoint to resume from cannot be loaded; the report names it
    DISK_FULL = 76  # no room (or a read-only file system) for a checkpoint or the report


class Stage(str, enum.Enum):
    """Where the child was when it failed. Set by the child, read by the classifier."""

    SETUP = "setup"
    LOAD = "load"
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"
    EVAL = "eval"
    SAVE = "save"
    MERGE = "merge"
    UNKNOWN = "unknown"

    @classmethod
    def named(cls, value: object) -> Stage:
        """The stage a file names; anything unknown (a newer child, a torn value) is UNKNOWN."""
        try:
            return cls(value)
        except ValueError:
            return cls.UNKNOWN


class FailureKind(str, enum.Enum):
    """The failure kinds of ARCHITECTURE.md."""

    OOM_LOAD = "oom_load"
    OOM_FORWARD = "oom_forward"
    OOM_BACKWARD = "oom_backward"
    OOM_OPTIMIZER = "oom_optimizer"
    OOM_EVAL = "oom_eval"
    OOM_MERGE = "oom_merge"
    OOM_FRAGMENTATION = "oom_fragmentation"
    OOM_CONTENTION = "oom_contention"
    HOST_OOM = "host_oom"
    HANG = "hang"
    BNB_CUDA_SETUP = "bnb_cuda_setup"
    NCCL = "nccl"
    CONFIG_ERROR = "config_error"
    CHECKPOINT_DAMAGED = "checkpoint_damaged"  # the resume checkpoint would not load: quarantine it
    DISK_FULL = "disk_full"  # ENOSPC / EROFS / EDQUOT writing a checkpoint, a report or the journal
    GPU_FAULT = "gpu_fault"  # an NVML Xid event during the attempt (supervisor/diagnosis/xid.py)
    OTHER = "other"

    @property
    def is_oom(self) -> bool:
        return self.value.startswith("oom_") or self is FailureKind.HOST_OOM


#: The stage-named OOM kind for each stage. Setup counts as load; a checkpoint save happens
#: between steps with the whole training state resident, so it takes the backward ladder.
OOM_KIND_BY_STAGE: Mapping[Stage, FailureKind] = {
    Stage.SETUP: FailureKind.OOM_LOAD,
    Stage.LOAD: FailureKind.OOM_LOAD,
    Stage.FORWARD: FailureKind.OOM_FORWARD,
    Stage.BACKWARD: FailureKind.OOM_BACKWARD,
    Stage.OPTIMIZER: FailureKind.OOM_OPTIMIZER,
    Stage.EVAL: FailureKind.OOM_EVAL,
    Stage.SAVE: FailureKind.OOM_BACKWARD,
    Stage.MERGE: FailureKind.OOM_MERGE,
}


@dataclasses.dataclass(frozen=True)
class Knobs:
    """Everything the policy ladder may change between attempts.

    ``micro_batch_size * grad_accum * world_size`` is the effective batch; rungs keep it.
    ``world_size`` is the number of ranks (``resources.nproc_per_node``): above 1 the child is
    started through torchrun, one rank per GPU, all ranks with these same knobs.
    """

    model: str
    micro_batch_size: int = 1
    grad_accum: int = 16
    max_seq_len: int = 512
    gradient_checkpointing: bool = True
    optimizer: str = "paged_adamw_8bit"
    lora_r: int = 8
    lora_alpha: int = 16
    quant_type: str = "nf4"
    double_quant: bool = True
    load_in_4bit: bool = True
    cpu_offload: bool = False
    # On by default: on the H200 it cost no tokens/s (+0.9 %, noise) and reserved 0.7 GiB less
    # (bench/results/memory-grid-h200-2026-12-01/rungs-table.txt), so it needs no attempt of its own.
    expandable_segments: bool = True
    eval_batch_size: int = 1
    eval_enabled: bool = True
    merge_on_cpu: bool = False
    world_size: int = 1  # journals and specs written before it had one process
    # The visible GPUs the ranks train on, by position in CUDA_VISIBLE_DEVICES, comma-separated, in
    # rank order; "" means the first world_size. drop_rank leaves the failing card out of it.
    gpus: str = ""

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum * self.world_size


@dataclasses.dataclass(frozen=True)
class DataSpec:
    """Where the training text comes from (validated by the supervisor before any attempt)."""

    path: str
    text_field: str | None = "text"
    messages_field: str | None = None
    eval_path: str | None = None
    eval_fraction: float = 0.0


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """The parts of the recipe no rung changes."""

    learning_rate: float = 2e-4
    lr_scheduler: str = "cosine"
    warmup_ratio: float = 0.03
    max_grad_norm: float = 0.3
    max_steps: int = -1
    epochs: float = 1.0
    save_steps: int = 50
    logging_steps: int = 10
    eval_steps: int | None = None
    packing: bool = False
    seed: int = 42
    lora_dropout: float = 0.05
    target_modules: tuple[str, ...] | str = ("q_proj", "k_proj", "v_proj", "o_proj")
    compute_dtype: str = "auto"
    trust_remote_code: bool = False
    merge: bool = False
    # Passed through to the Trainer: "none" or "tensorboard" (logs in <run_dir>/tensorboard,
    # one directory across attempts so the curves continue after a restart).
    report_to: str = "none"


@dataclasses.dataclass(frozen=True)
class Resources:
    """Where the child runs and the memory caps it applies to itself (bytes; None: no cap)."""

    device: str = "auto"  # "auto", "cpu", "cuda:N" or a GPU UUID
    gpu_memory_limit: int | None = None
    cpu_memory_limit: int | None = None


@dataclasses.dataclass(frozen=True)
class DiagnoseSpec:
    """Opt-in diagnostics of the child (the job's ``diagnose`` section).

    ``memory_history``: record the CUDA allocator's history
    (``torch.cuda.memory._record_memory_history``, at most ``memory_history_entries`` events)
    and dump it into the attempt's directory at an OOM (:data:`MEMORY_SNAPSHOT_NAME`), for
    PyTorch's memory viewer (https://pytorch.org/memory_viz). Off by default: recording costs
    throughput (README, Benchmarks).
    """

    memory_history: bool = False
    memory_history_entries: int = 100_000


#: The allocator snapshot an OOM leaves in ``attempt-NNN/`` when ``diagnose.memory_history`` is on.
MEMORY_SNAPSHOT_NAME = "memory-snapshot.pickle"
#: Sent by the supervisor when memory creeps towards the budget: the child saves a checkpoint at
#: the end of the step in flight, and after every step from then on (trainer_child/trainer.py).
EARLY_CHECKPOINT_SIGNAL = signal.SIGUSR1


@dataclasses.dataclass(frozen=True)
class AttemptSpec:
    """One attempt of the child: what to train, with which knobs, where to write.

    Memory caps are applied *inside* the child: ``gpu_memory_limit`` through
    ``torch.cuda.set_per_process_memory_fraction``, ``cpu_memory_limit`` through ``RLIMIT_DATA``.
    """

    attempt: int
    run_dir: str
    knobs: Knobs
    data: DataSpec
    train: TrainSpec
    events_file: str
    error_file: str
    checkpoints_dir: str
    adapter_dir: str
    merged_dir: str
    device: str = "auto"  # "auto", "cpu", "cuda:N" or a GPU UUID; both sides map it with bind_device
    gpu_memory_limit: int | None = None  # bytes
    cpu_memory_limit: int | None = None  # bytes
    heartbeat_interval: float = 5.0
    # Chosen by the supervisor (the newest complete checkpoint still valid for these knobs);
    # None: start from step 0.
    resume_from: str | None = None
    # The optimizer changed (or its state is suspect): keep adapter, step and data position,
    # start the optimizer state afresh.
    reset_optimizer: bool = False
    diagnose: DiagnoseSpec = DiagnoseSpec()
    # How long the supervisor waits after SIGTERM before SIGKILL (supervise.stop_grace); torchrun
    # is told the same (--shutdown-timeout), so it does not kill the ranks' checkpoint sooner.
    stop_grace_s: float = 180.0

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AttemptSpec:
        raw = json.loads(text)
        train = dict(raw["train"])
        if isinstance(train.get("target_modules"), list):
            train["target_modules"] = tuple(train["target_modules"])
        nested = ("knobs", "data", "train", "diagnose")
        return cls(
            **{k: v for k, v in raw.items() if k not in nested},
            knobs=Knobs(**raw["knobs"]),
            data=DataSpec(**raw["data"]),
            train=TrainSpec(**train),
            diagnose=DiagnoseSpec(**raw.get("diagnose", {})),
        )


@dataclasses.dataclass(frozen=True)
class ErrorReport:
    """What the child knew when it failed. Written atomically to ``spec.error_file``.

    ``step`` is the last *completed* optimizer step. ``oom_numbers`` uses the keys of
    :func:`qlora_supervise.trainer_child.oom_message.parse_numbers` (bytes as integers).
    ``allocator``: the CUDA allocator's facts read at the OOM (None on the CPU, for a failure
    that is not an OOM, or from a child older than them); ``memory_snapshot``: the path of the
    allocator snapshot dumped at the OOM (``diagnose.memory_history``), else None.
    """

    exit_code: int
    exception_type: str
    message: str
    traceback: str
    stage: Stage
    step: int
    is_oom: bool
    config_error: bool = False
    oom_numbers: dict[str, Any] = dataclasses.field(default_factory=dict)
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

    def __post_init__(self) -> None:
        # Reports are read back from JSON, where the stage is a plain string and the facts a dict.
        object.__setattr__(self, "stage", Stage.named(self.stage))
        if self.allocator is not None and not isinstance(self.allocator, AllocatorFacts):
            object.__setattr__(self, "allocator", AllocatorFacts.from_json_dict(self.allocator))

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True, default=str)

    @classmethod
    def from_json(cls, text: str) -> ErrorReport:
        """Raises ValueError for anything that is not a well-typed report."""
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("an error report must be a JSON object")
        known = {f.name for f in dataclasses.fields(cls)}
        report = cls(**{k: v for k, v in raw.items() if k in known})
        if not isinstance(report.step, int) or not isinstance(report.exit_code, int):
            raise ValueError("an error report needs integer step and exit_code")
        return report


def rank_gpus(knobs: Knobs) -> list[int]:
    """The positions (in the visible GPUs) that ranks 0, 1, ... of ``knobs`` train on."""
    if not knobs.gpus:
        return list(range(knobs.world_size))
    return [int(part) for part in knobs.gpus.split(",")]


def rank_file(path: str, rank: int) -> str:
    """Where rank ``rank`` writes a file the spec names once: rank 0 (and a single process) the
    path itself, rank N ``<stem>.rankN<suffix>`` beside it (``error.rank1.json``,
    ``child-events.rank1.jsonl``).

    Every rank writes its own error report and events (heartbeats with its own peak memory); only
    rank 0 writes checkpoints, the adapter and the ``finished`` event the supervisor waits for.
    """
    if rank == 0:
        return path
    name = Path(path)
    return str(name.with_name(f"{name.stem}.rank{rank}{name.suffix}"))


def rank_files(path: str) -> list[tuple[int, str]]:
    """``(rank, path)`` of every rank file of ``path`` that exists, rank 0 first."""
    found = [(0, path)] if Path(path).is_file() else []
    name = Path(path)
    for other in sorted(name.parent.glob(f"{name.stem}.rank*{name.suffix}")):
        number = other.name[len(name.stem) + len(".rank") : len(other.name) - len(name.suffix)]
        if number.isdigit() and int(number) > 0:
            found.append((int(number), str(other)))
    return sorted(found)


#: The last line the child prints to stderr on a failure: ``<prefix><stage>: <type>: <message>``.
#: The stage is the child's own; a log classified without the error report can still read it.
FAILURE_LINE_PREFIX = "trainer child failed in "


def failure_line(stage: str, exception_type: str, message: str) -> str:
    return f"{FAILURE_LINE_PREFIX}{stage}: {exception_type}: {message}"


EVENT_NAMES = frozenset(
    {
        "started",  # pid, rank, local_rank, world_size, device, versions, trust_remote_code
        "stage",  # stage changed (load, forward, ...)
        "loaded",  # model loaded: trainable params, share, MemoryNumbers, attempt_facts.SampleLengths
        "trainer_ready",  # phases_s (tokenizer, weights, lora, data, trainer); prepared by a spare?
        "heartbeat",  # a Heartbeat: stage, step, loss, tokens_per_s and MemoryNumbers
        "checkpoint_saved",  # step, path, emergency, early (asked for by EARLY_CHECKPOINT_SIGNAL)
        "early_checkpoint_requested",  # step: the signal arrived; a checkpoint follows this step
        "resumed",  # from_step, path, reset_optimizer, reset_reason; RankReduction fields when cut
        "finished",  # step, adapter path
        "stopping",  # graceful stop requested
        "merge_plan",  # the merge's memory plan: device, GPU and host needs, what was free
    }
)


def event_line(event: str, **fields: Any) -> str:
    """One line of the child's events file."""
    return json.dumps({"event": event, "time": time.time(), **fields}, default=str) + "\n"


class PeakSource(str, enum.Enum):
    """What :attr:`MemoryNumbers.peak_bytes` measured: the memory the attempt's cap limits."""

    CUDA_ALLOCATOR = "cuda_allocator"  # torch.cuda.max_memory_allocated on the training GPU
    DATA_SEGMENT = "data_segment"  # peak VmData on the CPU: what RLIMIT_DATA (cpu_memory_limit) caps
    RSS = "rss"  # VmHWM, where the data segment cannot be read


#: Keys of the events files written before :class:`MemoryNumbers` existed, in the precedence
#: order of the peak rule (the same order :meth:`MemoryNumbers.measured` applies).
_OLD_PEAK_KEYS = (
    ("peak", PeakSource.CUDA_ALLOCATOR),
    ("peak_vmdata", PeakSource.DATA_SEGMENT),
    ("peak_rss", PeakSource.RSS),
)
_OLD_GAUGE_KEYS = {
    "allocated": "allocated_bytes",
    "reserved": "reserved_bytes",
    "rss": "rss_bytes",
    "vmdata": "vmdata_bytes",
}


@dataclasses.dataclass(frozen=True)
class MemoryNumbers:
    """The child's memory at one moment, in bytes; None where it could not be read.

    ``peak_bytes`` is the one peak of the attempt so far, chosen once, here, by the child
    (:meth:`measured`); readers take it as it is and never re-derive it from the gauges.
    """

    peak_bytes: int | None = None
    peak_source: PeakSource | None = None
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
        """The peak rule: the CUDA allocator's peak on a GPU, else the data segment's, else VmHWM."""
        peak, source = _first_peak(
            (
                (cuda_peak, PeakSource.CUDA_ALLOCATOR),
                (data_segment_peak, PeakSource.DATA_SEGMENT),
                (rss_high_water, PeakSource.RSS),
            )
        )
        return cls(peak, source, allocated, reserved, rss, rss_high_water, vmdata)

    def fields(self) -> dict[str, Any]:
        """The JSON fields of an event line (flat, so ``jq .peak_bytes`` reads them)."""
        values = dataclasses.asdict(self)
        values["peak_source"] = self.peak_source.value if self.peak_source is not None else None
        return values

    @classmethod
    def from_fields(cls, raw: Mapping[str, Any]) -> MemoryNumbers:
        """Read an event's memory fields; ill-typed values become None.

        Events files written before this record (keys ``peak``, ``peak_vmdata``, ``peak_rss``,
        ``allocated``, ``reserved``, ``rss``, ``vmdata``) are read with the same peak rule.
        """
        if "peak_bytes" in raw:
            source = raw.get("peak_source")
            return cls(
                peak_bytes=_int_or_none(raw.get("peak_bytes")),
                peak_source=PeakSource(source) if source in _PEAK_SOURCES else None,
                **{name: _int_or_none(raw.get(name)) for name in _GAUGE_FIELDS},
            )
        peak, source = _first_peak(tuple((_int_or_none(raw.get(key)), src) for key, src in _OLD_PEAK_KEYS))
        return cls(
            peak_bytes=peak,
            peak_source=source,
            rss_high_water_bytes=_int_or_none(raw.get("peak_rss")),
            **{new: _int_or_none(raw.get(old)) for old, new in _OLD_GAUGE_KEYS.items()},
        )


_PEAK_SOURCES = frozenset(source.value for source in PeakSource)
_GAUGE_FIELDS = ("allocated_bytes", "reserved_bytes", "rss_bytes", "rss_high_water_bytes", "vmdata_bytes")


def _first_peak(
    candidates: tuple[tuple[int | None, PeakSource], ...],
) -> tuple[int | None, PeakSource | None]:
    # `or` semantics of the old reader: a zero peak (nothing allocated yet) falls through too.
    for value, source in candidates:
        if value:
            return value, source
    return None, None


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _float_or_none(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


@dataclasses.dataclass(frozen=True)
class Heartbeat:
    """One ``heartbeat`` event: where the child is, how fast it goes, and its memory.

    ``step`` is the last completed optimizer step; the supervisor decides hangs from ``step``
    and ``stage`` not changing, so a beat is sent whatever the main thread does.
    """

    stage: Stage
    step: int
    loss: float | None = None
    tokens_per_s: float | None = None
    memory: MemoryNumbers = MemoryNumbers()

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
        return event_line("heartbeat", **self.fields())

    @classmethod
    def from_fields(cls, raw: Mapping[str, Any]) -> Heartbeat | None:
        """The heartbeat in a parsed event line (today's keys or older ones); None when the
        line has no integer step (not a heartbeat this reader can trust)."""
        step = _int_or_none(raw.get("step"))
        if step is None:
            return None
        return cls(
            stage=Stage.named(raw.get("stage")),
            step=step,
            loss=_float_or_none(raw.get("loss")),
            tokens_per_s=_float_or_none(raw.get("tokens_per_s")),
            memory=MemoryNumbers.from_fields(raw),
        )


class DeviceError(ValueError):
    """A job's device that names no GPU this process could hand to the child."""


@dataclasses.dataclass(frozen=True)
class DeviceBinding:
    """The one GPU an attempt trains on, named as each side needs it.

    ``child_visible_devices`` is what the child sets ``CUDA_VISIBLE_DEVICES`` to before CUDA
    starts (``""`` hides every GPU), so that it sees exactly that GPU as ``cuda:0``.
    ``nvml_target`` is what the supervisor's NVML monitor watches: a physical index (NVML ignores
    ``CUDA_VISIBLE_DEVICES``), a ``GPU-``/``MIG-`` UUID or unique UUID prefix, or None for nothing.
    """

    child_visible_devices: str
    nvml_target: int | str | None


_UUID_PREFIXES = ("GPU-", "MIG-")


def bind_device(device: str, inherited_visible: str | None) -> DeviceBinding:
    """Map the job's ``device`` through the ``CUDA_VISIBLE_DEVICES`` both sides inherit.

    ``device`` is ``auto`` (the first visible GPU), ``cpu``, ``N`` or ``cuda:N`` (the N-th GPU
    *visible to the supervisor*, as CUDA itself would count it), or a GPU/MIG UUID (that GPU,
    whatever the list says). The supervisor and the child both call this with the same inputs
    (the child inherits the supervisor's environment), so they cannot disagree on the GPU.
    Without the variable, index N means CUDA's device N, which NVML numbers the same only when
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or all GPUs are one model. Raises :class:`DeviceError`
    for an unknown form or an index beyond the visible list.
    """
    text = device.strip()
    if text == "cpu":
        return DeviceBinding("", None)
    if text.startswith(_UUID_PREFIXES):
        return DeviceBinding(text, text)
    if text == "auto":
        position = 0
    elif text.removeprefix("cuda:").isdigit():
        position = int(text.removeprefix("cuda:"))
    else:
        raise DeviceError(
            f"device {device!r}: use auto, cpu, a GPU index (0), cuda:N, or a GPU UUID (GPU-... or MIG-...)"
        )
    visible = visible_entries(inherited_visible)
    if visible is None:
        return DeviceBinding(str(position), position)
    if position >= len(visible):
        if text == "auto":  # nothing visible: an auto job trains on the CPU
            return DeviceBinding("", None)
        raise DeviceError(
            f"device {device!r}: CUDA_VISIBLE_DEVICES={inherited_visible!r} makes {len(visible)} GPU(s) "
            f"visible; use an index below {len(visible)}, a GPU UUID, or change CUDA_VISIBLE_DEVICES"
        )
    entry = visible[position]
    return DeviceBinding(entry, int(entry) if entry.isdigit() else entry)


def visible_entries(value: str | None) -> list[str] | None:
    """The GPUs a ``CUDA_VISIBLE_DEVICES`` value lists, in order; None when it is unset.

    Like CUDA, the list ends at the first entry that is neither an index nor a UUID (``-1``
    hides every GPU after it).
    """
    if value is None:
        return None
    entries: list[str] = []
    for raw in value.split(","):
        entry = raw.strip()
        if not (entry.isdigit() or entry.startswith(_UUID_PREFIXES)):
            break
        entries.append(entry)
    return entries
