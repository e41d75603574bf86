"""The sections of a job file as frozen pydantic models (the shape pass, one section at a time), and
their field types: before-validators turn the file's spellings into one form (``24GiB`` -> bytes,
``20m`` -> seconds, ``1`` -> ``cuda:1``, relative paths -> absolute) or raise ``job_error``.
A field that lands in a spec for the child or in the policy's ``Settings`` takes that dataclass's
default (``tests/test_job.py`` checks they agree)."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, cast

import pydantic
from pydantic import AfterValidator, BeforeValidator, Field, ValidationInfo, field_validator, model_validator

from qlora_supervise.policies.decide import Settings
from qlora_supervise.policies.rungs import RETIRED_RUNGS, RUNG_NAMES
from qlora_supervise.supervisor.facts import units
from qlora_supervise.supervisor.jobfile import hub
from qlora_supervise.supervisor.jobfile.problems import did_you_mean, job_error
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.spec import DataSpec, DiagnoseSpec, Knobs, Resources, TrainSpec
from qlora_supervise.trainer_child.contract.targets import KEYWORDS as TARGET_KEYWORDS


def _job_dir(info: ValidationInfo) -> Path:
    return Path(str((info.context or {}).get("job_dir", os.getcwd())))


def _resolve_path(value: object, info: ValidationInfo) -> object:
    """A non-empty path -> an absolute, normalised Path relative to the job file's folder (never the cwd)."""
    if isinstance(value, Path):
        path = value
    elif isinstance(value, str) and value.strip():
        path = Path(value.strip()).expanduser()
    else:
        raise job_error("not a path", "write a file or directory path (relative to the job file)")
    if "\0" in str(path):  # no system call takes it (every later check would end in a ValueError)
        raise job_error("holds a NUL character, which no path can", "write the path without it")
    return Path(os.path.normpath(_job_dir(info) / path))


def list_to_tuple(value: object) -> object:
    """YAML lists become tuples, so that frozen sections hold nothing mutable."""
    return tuple(value) if isinstance(value, list) else value


def _yaml_float(value: object) -> object:
    """A number YAML 1.1 left as a string (``2e-4``) -> float; anything else unchanged."""
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return float(value)
    return value


def _bytes(value: object) -> object:
    """``24GiB`` / ``64GB`` -> bytes (int); a bare number (``24``) is refused with the fix."""
    if not isinstance(value, (str, int, float)):
        return value  # the int type check reports it
    try:
        return units.parse_bytes(value, unit_required=True)
    except units.UnitError as error:
        fix = error.expected if "no unit" in error.reason or "bits" in error.reason else units.SIZE_HELP
        raise job_error(f"bad byte size: {error.reason}", f"use {fix}") from None


def to_seconds(value: object) -> object:
    """``20m`` / ``1h30m`` / a plain number -> seconds (float); ``jobfile.advice`` warns of a plain number."""
    if not isinstance(value, (str, int, float)):
        return value
    try:
        return units.parse_duration(value)
    except units.UnitError as error:
        raise job_error(f"bad duration: {error.reason}", f"use {units.DURATION_HELP}") from None


def _device(value: object) -> object:
    """``0`` / ``cuda:0`` -> ``cuda:0``; ``auto``, ``cpu`` and GPU/MIG UUIDs unchanged."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return f"cuda:{value}"
    if isinstance(value, str):
        if (text := value.strip()) in ("auto", "cpu") or re.match(r"^(GPU|MIG)-[0-9a-fA-F-]+$", text):
            return text
        if re.fullmatch(r"(cuda:)?\d+", text):
            return f"cuda:{text.removeprefix('cuda:')}"
    raise job_error("not a device", "use auto, cpu, a GPU index (0), cuda:N, or a GPU UUID (GPU-...)")


def _target_modules(value: object) -> object:
    """``attention`` / ``mlp`` / ``all-linear`` or a non-empty list of module names (as a tuple)."""
    if value in TARGET_KEYWORDS:
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, str) and m for m in value):
        return tuple(value)
    fix = "use attention, mlp, all-linear or a non-empty list such as [q_proj, k_proj, v_proj, o_proj]"
    raise job_error("not a list of module names", fix)


def _hook_argv(value: object) -> object:
    """A non-empty list of strings: the hook's argv. A string is refused (no shell, ever)."""
    if isinstance(value, str):
        raise job_error(
            "a shell string (hooks run without a shell, so quoting and pipes would not work)",
            f"write an argv list, e.g. [/usr/local/bin/notify-lab, --channel, ml]; "
            f"for a pipeline use [sh, -c, {value!r}] on purpose",
        )
    if isinstance(value, (list, tuple)) and value and all(isinstance(a, str) and a for a in value):
        return tuple(value)
    raise job_error("not an argv list", "write a non-empty list of strings, e.g. [mail, -s, qlora, me@lab]")


def _ladders(value: object) -> object:
    """A key naming a FailureKind becomes one (the others fail the key check); lists become tuples."""
    if not isinstance(value, dict):
        return value
    kinds = {kind.value: kind for kind in FailureKind}
    return {kinds.get(k, k) if isinstance(k, str) else k: list_to_tuple(v) for k, v in value.items()}


def _rung_name(value: str) -> str:
    if value in RETIRED_RUNGS:
        raise job_error(RETIRED_RUNGS[value], "remove it from the ladder, or name activation_offload")
    if value not in RUNG_NAMES:
        raise job_error("unknown rung", did_you_mean(value, RUNG_NAMES))
    return value


def _only_true(value: bool) -> bool:
    if not value:
        raise job_error(
            "a smaller effective batch saves no memory (halving the micro-batch raises accumulation "
            "instead), so the supervisor always keeps it",
            "delete the line or set keep_effective_batch: true",
        )
    return value


ResolvedPath = Annotated[Path, BeforeValidator(_resolve_path)]
Name = Annotated[str, Field(min_length=1)]
PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
Fraction = Annotated[float, BeforeValidator(_yaml_float), Field(ge=0.0, lt=1.0)]
PositiveFloat = Annotated[float, BeforeValidator(_yaml_float), Field(gt=0.0, allow_inf_nan=False)]
NonNegativeFloat = Annotated[float, BeforeValidator(_yaml_float), Field(ge=0.0, allow_inf_nan=False)]
ByteSize = Annotated[int, BeforeValidator(_bytes), Field(gt=0)]
Seconds = Annotated[float, BeforeValidator(to_seconds), Field(gt=0.0)]
SecondsOrZero = Annotated[float, BeforeValidator(to_seconds), Field(ge=0.0)]
Device = Annotated[str, BeforeValidator(_device)]
TargetModules = Annotated[tuple[str, ...] | str, BeforeValidator(_target_modules)]
RungName = Annotated[str, AfterValidator(_rung_name)]
Ladders = Annotated[dict[FailureKind, tuple[RungName, ...]], BeforeValidator(_ladders)]
HookArgv = Annotated[tuple[str, ...], BeforeValidator(_hook_argv)]
PathList = Annotated[tuple[ResolvedPath, ...], BeforeValidator(list_to_tuple)]

Optimizer = Literal["paged_adamw_8bit", "adamw_8bit", "paged_adamw_32bit", "adamw_torch", "adamw_torch_fused"]
Scheduler = Literal["cosine", "linear", "constant", "constant_with_warmup"]
QuantType = Literal["nf4", "fp4"]
ComputeDtype = Literal["auto", "bf16", "fp16", "fp32"]
ReportTo = Literal["none", "tensorboard"]


class Section(pydantic.BaseModel):
    """A part of the job file; frozen, unknown keys refused."""

    # strict: YAML already gives ints, floats and bools; "8" for an int is a mistake worth naming.
    model_config = pydantic.ConfigDict(frozen=True, extra="forbid", strict=True, validate_default=True)


class ModelSection(Section):
    """``path`` is a local directory or a hub id (``org/name``), resolved to its cached snapshot."""

    allow_download: bool = False  # before ``path``: its validator reads it (pydantic validates in order)
    path: ResolvedPath
    fallbacks: PathList = ()  # smaller models for the last rung; none unless named
    trust_remote_code: bool = TrainSpec.trust_remote_code

    @field_validator("path", mode="before")
    @classmethod
    def _hub_id_to_snapshot(cls, value: Any, info: ValidationInfo) -> Any:
        if not isinstance(value, str) or not hub.looks_like_hub_id(value.strip(), _job_dir(info)):
            return value
        return hub.resolve_hub_id(value.strip(), info.data.get("allow_download") is True)


class DataSection(Section):
    path: ResolvedPath
    text_field: Name | None = DataSpec.text_field
    messages_field: Name | None = DataSpec.messages_field
    eval_path: ResolvedPath | None = None  # DataSpec.eval_path's None, as a Path
    eval_fraction: Fraction = DataSpec.eval_fraction

    @model_validator(mode="before")
    @classmethod
    def _messages_replace_default_text(cls, data: Any) -> Any:
        # text_field defaults to "text" only while messages_field is not given.
        if isinstance(data, dict) and data.get("messages_field") is not None and "text_field" not in data:
            return {**data, "text_field": None}
        return data


class QuantizationSection(Section):
    load_in_4bit: bool = Knobs.load_in_4bit
    quant_type: QuantType = cast(QuantType, Knobs.quant_type)
    double_quant: bool = Knobs.double_quant
    compute_dtype: ComputeDtype = cast(ComputeDtype, TrainSpec.compute_dtype)


class LoraSection(Section):
    r: PositiveInt = Knobs.lora_r
    alpha: PositiveInt = Knobs.lora_alpha
    dropout: Fraction = TrainSpec.lora_dropout
    target_modules: TargetModules = TrainSpec.target_modules


class TrainSection(Section):
    max_seq_len: PositiveInt = Knobs.max_seq_len
    micro_batch_size: PositiveInt = Knobs.micro_batch_size
    effective_batch_size: PositiveInt = Knobs(model="").effective_batch
    gradient_checkpointing: bool = Knobs.gradient_checkpointing
    optimizer: Optimizer = cast(Optimizer, Knobs.optimizer)
    learning_rate: PositiveFloat = TrainSpec.learning_rate
    lr_scheduler: Scheduler = cast(Scheduler, TrainSpec.lr_scheduler)
    warmup_ratio: Fraction = TrainSpec.warmup_ratio
    max_grad_norm: NonNegativeFloat = TrainSpec.max_grad_norm
    max_steps: PositiveInt | None = None  # None: epochs decide (TrainSpec spells it -1)
    epochs: PositiveFloat | None = TrainSpec.epochs
    save_steps: PositiveInt = TrainSpec.save_steps
    logging_steps: PositiveInt = TrainSpec.logging_steps
    eval_steps: PositiveInt | None = TrainSpec.eval_steps
    eval_batch_size: PositiveInt = Knobs.eval_batch_size
    packing: bool = TrainSpec.packing
    seed: NonNegativeInt = TrainSpec.seed
    merge: bool = TrainSpec.merge
    report_to: ReportTo = cast(ReportTo, TrainSpec.report_to)


class ResourcesSection(Section):
    gpu: Device = Resources.device
    gpu_memory_limit: ByteSize | None = Resources.gpu_memory_limit
    cpu_memory_limit: ByteSize | None = Resources.cpu_memory_limit
    # Host RAM the plan may use (issue 28); default: what is available at start, less a reserve.
    host_memory_limit: ByteSize | None = Resources.host_memory_limit
    expandable_segments: bool = Knobs.expandable_segments
    nproc_per_node: PositiveInt = Knobs.world_size
    parallel: Literal["ddp", "fsdp"] = "fsdp" if Knobs.fsdp else "ddp"

    def spec(self) -> Resources:
        return Resources(self.gpu, self.gpu_memory_limit, self.cpu_memory_limit, self.host_memory_limit)


class SuperviseSection(Section):
    """How the loop supervises (docs/job-file.md): budgets, timeouts and ladders. Durations are seconds.
    ``keep_effective_batch`` is a guarantee, not a knob: ``false`` is refused with the reason."""

    max_attempts: PositiveInt = Settings.max_attempts
    hang_timeout: Seconds = 1200.0
    hang_grace: SecondsOrZero = 10.0
    max_no_progress_attempts: PositiveInt = Settings.max_no_progress
    backoff_initial: Seconds = 2.0
    backoff_max: Seconds = 60.0
    keep_effective_batch: Annotated[bool, AfterValidator(_only_true)] = True
    contention_wait: SecondsOrZero = Settings.contention_wait_s
    disk_wait: SecondsOrZero = Settings.disk_wait_s  # a full disk: wait this long for room
    degrade_on_contention: bool = Settings.degrade_on_contention
    step_up: bool = Settings.step_up
    step_up_settle: Seconds = Settings.step_up_settle_s
    step_up_quality: bool = Settings.step_up_quality
    calibration_store: bool = True  # per-host peaks: the next run starts calibrated (record/peak_store.py)
    # Attempt 1 times the planner's top candidates and trains with the fastest (policies/choice.py).
    speed_trial: bool = Settings.speed_trial
    warm_spare: bool | Literal["auto"] = "auto"
    ladders: Ladders = Field(default_factory=dict)  # by failure kind; none: the built-in ladders
    stop_grace: Seconds = 180.0
    on_event: HookArgv | None = None
    on_event_timeout: Seconds = 30.0
    metrics_textfile: ResolvedPath | None = None


class DiagnoseSection(Section):
    """Opt-in diagnostics (contract.spec.DiagnoseSpec): the CUDA allocator's history at an OOM."""

    memory_history: bool = DiagnoseSpec.memory_history
    memory_history_entries: PositiveInt = DiagnoseSpec.memory_history_entries

    def spec(self) -> DiagnoseSpec:
        return DiagnoseSpec(self.memory_history, self.memory_history_entries)


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
