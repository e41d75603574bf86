"""The one contract between the supervisor and the trainer child.

Standard library only: the supervisor imports this module and must never pull in torch.

The supervisor writes an :class:`AttemptSpec` to ``attempt-NNN/spec.json`` and starts
``python -m qlora_supervise.trainer_child --spec attempt-NNN/spec.json``. The child speaks back
through files, never through log scraping:

* ``spec.events_file``: one JSON object per line (:func:`event_line`), ``"event"`` is one of
  :data:`EVENT_NAMES`; heartbeats carry stage, step, loss, tokens/s and memory numbers.
* ``spec.error_file``: an :class:`ErrorReport`, written atomically, on any failure.
* the exit code, one of the reserved :class:`ExitCode` values.

Durable writes, checkpoint names and process checks that both sides share live beside it in
:mod:`.durable`, :mod:`.checkpoint_dirs` and :mod:`.processes`, which are standard library only too.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import time
from collections.abc import Mapping
from typing import Any


class ExitCode(enum.IntEnum):
    """Reserved exit codes of the trainer child (gunicorn-style: they stop restart loops)."""

    OK = 0
    OOM = 70  # memory ran out; the error report says where and with which numbers
    CONFIG = 71  # bad job, model, data or target_modules: never retried
    FAILED = 72  # any other exception; the report has the traceback
    STOPPED = 73  # asked to stop (SIGTERM), checkpointed first: resumable


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

    ``micro_batch_size * grad_accum`` (times processes) is the effective batch; rungs keep it.
    """

    model: str
    micro_batch_size: int = 1
    grad_accum: int = 16
    max_seq_len: int = 512
    gradient_checkpointing: bool = False
    optimizer: str = "paged_adamw_8bit"
    lora_r: int = 8
    lora_alpha: int = 16
    quant_type: str = "nf4"
    double_quant: bool = True
    load_in_4bit: bool = True
    cpu_offload: bool = False
    expandable_segments: bool = False
    eval_batch_size: int = 1
    eval_enabled: bool = True
    merge_on_cpu: bool = False

    @property
    def effective_batch(self) -> int:
        return self.micro_batch_size * self.grad_accum


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
    device: str = "auto"  # "auto", "cpu", "cuda:N" or a GPU UUID
    gpu_memory_limit: int | None = None  # bytes
    cpu_memory_limit: int | None = None  # bytes
    heartbeat_interval: float = 5.0
    # Chosen by the supervisor (the newest complete checkpoint still valid for these knobs);
    # None: start from step 0.
    resume_from: str | None = None
    # The optimizer changed (or its state is suspect): keep adapter, step and data position,
    # start the optimizer state afresh.
    reset_optimizer: bool = False

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> AttemptSpec:
        raw = json.loads(text)
        train = dict(raw["train"])
        if isinstance(train.get("target_modules"), list):
            train["target_modules"] = tuple(train["target_modules"])
        return cls(
            **{k: v for k, v in raw.items() if k not in ("knobs", "data", "train")},
            knobs=Knobs(**raw["knobs"]),
            data=DataSpec(**raw["data"]),
            train=TrainSpec(**train),
        )


@dataclasses.dataclass(frozen=True)
class ErrorReport:
    """What the child knew when it failed. Written atomically to ``spec.error_file``.

    ``step`` is the last *completed* optimizer step. ``oom_numbers`` uses the keys of
    :func:`qlora_supervise.trainer_child.oom_message.parse_numbers` (bytes as integers).
    """

    exit_code: int
    exception_type: str
    message: str
    traceback: str
    stage: str
    step: int
    is_oom: bool
    config_error: bool = False
    oom_numbers: dict[str, Any] = dataclasses.field(default_factory=dict)
    memory_stats: dict[str, Any] | None = None
    device: str = "cpu"
    emergency_checkpoint: str | None = None  # path of the checkpoint saved after the failure
    emergency_step: int | None = None
    expandable_segments_active: bool | None = None
    time: float = dataclasses.field(default_factory=time.time)

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


#: The last line the child prints to stderr on a failure: ``<prefix><stage>: <type>: <message>``.
#: The stage is the child's own; a log classified without the error report can still read it.
FAILURE_LINE_PREFIX = "trainer child failed in "


def failure_line(stage: str, exception_type: str, message: str) -> str:
    return f"{FAILURE_LINE_PREFIX}{stage}: {exception_type}: {message}"


EVENT_NAMES = frozenset(
    {
        "started",  # pid, device, versions
        "stage",  # stage changed (load, forward, ...)
        "loaded",  # model loaded: trainable params, share, memory
        "heartbeat",  # stage, step, loss, tokens_per_s, allocated, reserved, peak, rss
        "checkpoint_saved",  # step, path, emergency
        "resumed",  # from_step, path
        "finished",  # step, adapter path
        "stopping",  # graceful stop requested
    }
)


def event_line(event: str, **fields: Any) -> str:
    """One line of the child's events file."""
    return json.dumps({"event": event, "time": time.time(), **fields}, default=str) + "\n"
