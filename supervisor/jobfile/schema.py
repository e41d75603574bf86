"""The sections of a job file, as frozen pydantic models: the shape pass of validation.

Each section is validated on its own (types, units, ranges, allowed values, unknown keys), so
one bad section does not hide another's problems.

One set of defaults: a field that lands in a spec crossing to the child (``Knobs``,
``DataSpec``, ``TrainSpec``, ``Resources``) or in the policy's ``Settings`` takes its default
from that dataclass, never a number of its own. Only what nothing else knows about (durations
of the loop, ``keep_effective_batch``, the fallbacks) has its default here.
``tests/test_job.py`` walks the dataclass fields and fails where a default disagrees.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from qlora_supervise.policies.decide import Settings
from qlora_supervise.supervisor.jobfile import hub
from qlora_supervise.supervisor.jobfile.fields import (
    ByteSize,
    ComputeDtype,
    Device,
    Fraction,
    HookArgv,
    Ladders,
    Name,
    NonNegativeFloat,
    NonNegativeInt,
    Optimizer,
    PathList,
    PositiveFloat,
    PositiveInt,
    QuantType,
    ReportTo,
    ResolvedPath,
    Scheduler,
    Seconds,
    SecondsOrZero,
    TargetModules,
    job_error,
)
from qlora_supervise.trainer_child.contract.spec import DataSpec, DiagnoseSpec, Knobs, Resources, TrainSpec

# The protocol's defaults, read off default instances (the required fields get placeholders that
# no section reads).
_KNOBS = Knobs(model="")
_DATA = DataSpec(path="")
_TRAIN = TrainSpec()
_RESOURCES = Resources()
_SETTINGS = Settings()
_DIAGNOSE = DiagnoseSpec()


class Section(BaseModel):
    """A part of the job file; frozen, unknown keys refused."""

    # strict: YAML already gives ints, floats and bools; "8" for an int is a mistake worth naming.
    # validate_default: a protocol default the schema would refuse (the casts below to the allowed
    # values are checked here) fails every load and the defaults test, never an attempt.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, validate_default=True)


class ModelSection(Section):
    """``path`` is a local directory or a hub id (``org/name``), resolved to its cached snapshot."""

    # Declared before ``path``: the path's validator reads it (pydantic validates in field order).
    # A hub id not in the local cache is downloaded only when this is true and the machine is online.
    allow_download: bool = False
    path: ResolvedPath
    fallbacks: PathList = ()  # smaller models for the last rung; none unless named
    trust_remote_code: bool = _TRAIN.trust_remote_code

    @field_validator("path", mode="before")
    @classmethod
    def _hub_id_to_snapshot(cls, value: Any, info: ValidationInfo) -> Any:
        if not isinstance(value, str):
            return value
        job_dir = Path(str((info.context or {}).get("job_dir", os.getcwd())))
        if not hub.looks_like_hub_id(value.strip(), job_dir):
            return value
        return hub.resolve_hub_id(value.strip(), info.data.get("allow_download") is True)


class DataSection(Section):
    path: ResolvedPath
    text_field: Name | None = _DATA.text_field
    messages_field: Name | None = _DATA.messages_field
    eval_path: ResolvedPath | None = None  # DataSpec.eval_path's None, as a Path
    eval_fraction: Fraction = _DATA.eval_fraction

    @model_validator(mode="before")
    @classmethod
    def _messages_replace_default_text(cls, data: Any) -> Any:
        # text_field defaults to "text" only while messages_field is not given.
        if isinstance(data, dict) and data.get("messages_field") is not None and "text_field" not in data:
            return {**data, "text_field": None}
        return data


class QuantizationSection(Section):
    load_in_4bit: bool = _KNOBS.load_in_4bit
    quant_type: QuantType = cast(QuantType, _KNOBS.quant_type)
    double_quant: bool = _KNOBS.double_quant
    compute_dtype: ComputeDtype = cast(ComputeDtype, _TRAIN.compute_dtype)


class LoraSection(Section):
    r: PositiveInt = _KNOBS.lora_r
    alpha: PositiveInt = _KNOBS.lora_alpha
    dropout: Fraction = _TRAIN.lora_dropout
    target_modules: TargetModules = _TRAIN.target_modules


class TrainSection(Section):
    max_seq_len: PositiveInt = _KNOBS.max_seq_len
    micro_batch_size: PositiveInt = _KNOBS.micro_batch_size
    effective_batch_size: PositiveInt = _KNOBS.effective_batch
    gradient_checkpointing: bool = _KNOBS.gradient_checkpointing
    optimizer: Optimizer = cast(Optimizer, _KNOBS.optimizer)
    learning_rate: PositiveFloat = _TRAIN.learning_rate
    lr_scheduler: Scheduler = cast(Scheduler, _TRAIN.lr_scheduler)
    warmup_ratio: Fraction = _TRAIN.warmup_ratio
    max_grad_norm: NonNegativeFloat = _TRAIN.max_grad_norm
    max_steps: PositiveInt | None = None  # None: epochs decide (TrainSpec spells it -1)
    epochs: PositiveFloat | None = _TRAIN.epochs
    save_steps: PositiveInt = _TRAIN.save_steps
    logging_steps: PositiveInt = _TRAIN.logging_steps
    eval_steps: PositiveInt | None = _TRAIN.eval_steps
    eval_batch_size: PositiveInt = _KNOBS.eval_batch_size
    packing: bool = _TRAIN.packing
    seed: NonNegativeInt = _TRAIN.seed
    merge: bool = _TRAIN.merge
    report_to: ReportTo = cast(ReportTo, _TRAIN.report_to)


class ResourcesSection(Section):
    gpu: Device = _RESOURCES.device
    gpu_memory_limit: ByteSize | None = _RESOURCES.gpu_memory_limit
    cpu_memory_limit: ByteSize | None = _RESOURCES.cpu_memory_limit
    # The host RAM this job's plan may use (issue 28): candidates whose training host peak is
    # over it are not started. Default: what is available when the run starts, less a reserve.
    host_memory_limit: ByteSize | None = _RESOURCES.host_memory_limit
    # The allocator's expandable segments (PYTORCH_ALLOC_CONF); false only where a platform lacks them.
    expandable_segments: bool = _KNOBS.expandable_segments
    # torchrun's own name: ranks on this host, one GPU each (gloo ranks on the CPU); above 1 the
    # child starts through `python -m torch.distributed.run` (supervisor/loop/launch.py).
    nproc_per_node: PositiveInt = _KNOBS.world_size


def _only_true(value: bool) -> bool:
    if not value:
        raise job_error(
            "a smaller effective batch saves no memory (halving the micro-batch raises accumulation "
            "instead), so the supervisor always keeps it",
            "delete the line or set keep_effective_batch: true",
        )
    return value


class SuperviseSection(Section):
    """How the loop supervises: budgets, timeouts and ladders. Durations are seconds.

    ``keep_effective_batch`` is a guarantee, not a knob: only ``true`` is accepted. Halving the
    micro-batch raises accumulation to match and can always reach micro-batch 1, and memory does
    not depend on the effective batch at a given micro-batch, so lowering it would cost quality
    and save no memory; ``false`` is refused with that reason rather than accepted and ignored.
    """

    max_attempts: PositiveInt = _SETTINGS.max_attempts
    hang_timeout: Seconds = 1200.0
    # SIGTERM grace of a hung child, before SIGKILL: a hung process cannot use the stop grace
    # (minutes, for a checkpoint) anyway, so a hang costs this much, not the full grace.
    hang_grace: SecondsOrZero = 10.0
    max_no_progress_attempts: PositiveInt = _SETTINGS.max_no_progress
    backoff_initial: Seconds = 2.0
    backoff_max: Seconds = 60.0
    keep_effective_batch: Annotated[bool, AfterValidator(_only_true)] = True
    contention_wait: SecondsOrZero = _SETTINGS.contention_wait_s
    disk_wait: SecondsOrZero = _SETTINGS.disk_wait_s  # a full disk: wait this long for room
    degrade_on_contention: bool = _SETTINGS.degrade_on_contention
    # Keep observed peaks per host so the next run starts calibrated (record/peak_store.py).
    calibration_store: bool = True
    # Attempt 1 times the planner's top candidates (micro-batch, checkpointing) before step 1 and
    # trains with the fastest (policies/choice.py decides); false: no trial.
    speed_trial: bool = _SETTINGS.speed_trial
    # A warm spare trainer (loop/spare.py): the next attempt skips the stack's imports. auto:
    # on with 4+ usable CPUs; host RAM short turns it off either way.
    warm_spare: bool | Literal["auto"] = "auto"
    ladders: Ladders = Field(default_factory=dict)  # by failure kind; none: the built-in ladders
    # How long a stop (SIGTERM, `systemctl stop`) waits for the child's checkpoint before SIGKILL.
    stop_grace: Seconds = 180.0
    # A command (argv list, never a shell string) run on retry, gave_up and run_succeeded, with
    # the event as JSON on stdin; a failing or slow hook is logged and never stops the run.
    on_event: HookArgv | None = None
    on_event_timeout: Seconds = 30.0
    # node_exporter textfile-collector file (written atomically); None: no metrics.
    metrics_textfile: ResolvedPath | None = None


class DiagnoseSection(Section):
    """Opt-in diagnostics (contract.spec.DiagnoseSpec): ``memory_history`` records the CUDA allocator's
    history and dumps a snapshot for PyTorch's memory viewer at an OOM."""

    memory_history: bool = _DIAGNOSE.memory_history
    memory_history_entries: PositiveInt = _DIAGNOSE.memory_history_entries


SECTIONS: Mapping[str, type[Section]] = {
    "model": ModelSection,
    "data": DataSection,
    "quantization": QuantizationSection,
    "lora": LoraSection,
    "train": TrainSection,
    "resources": ResourcesSection,
    "supervise": SuperviseSection,
    "diagnose": DiagnoseSection,
}
REQUIRED_SECTIONS = ("model", "data")
TOP_LEVEL_KEYS = frozenset({*SECTIONS, "output_dir"})
DEFAULT_OUTPUT_DIR = "./run"
