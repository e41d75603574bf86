"""The field types of the job schema: what one value may be, and how its spellings normalise.

Each type is an ``Annotated`` pydantic type. Before-validators turn the job file's spellings
into one form (``24GiB`` -> bytes, ``20m`` -> seconds, ``1`` -> ``cuda:1``, relative paths ->
absolute ones); a value they cannot read raises :func:`job_error`, whose problem and fix
``load`` turns into a :class:`~qlora_supervise.supervisor.jobfile.problems.Problem`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field, ValidationInfo
from pydantic_core import PydanticCustomError

from qlora_supervise.policies.rungs import RETIRED_RUNGS, RUNG_NAMES
from qlora_supervise.supervisor.facts.units import (
    DURATION_HELP,
    SIZE_HELP,
    UnitError,
    parse_bytes,
    parse_duration,
)
from qlora_supervise.supervisor.jobfile.problems import did_you_mean
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.targets import KEYWORDS as TARGET_KEYWORDS

#: The pydantic error type of :func:`job_error`; its ctx carries ``problem`` and ``fix``.
JOB_ERROR_TYPE = "job"


def job_error(problem: str, fix: str) -> PydanticCustomError:
    """The error a validator raises: the problem and its fix travel apart in ctx."""
    return PydanticCustomError(JOB_ERROR_TYPE, "{problem}", {"problem": problem, "fix": fix})


def _resolve_path(value: object, info: ValidationInfo) -> object:
    """A non-empty path string (or Path) -> an absolute, normalised Path."""
    # Relative paths are taken from the job file's directory (context "job_dir"), never the cwd.
    if isinstance(value, Path):
        path = value
    elif isinstance(value, str) and value.strip():
        path = Path(value.strip()).expanduser()
    else:
        raise job_error("not a path", "write a file or directory path (relative to the job file)")
    if "\0" in str(path):  # no system call takes it (every later check would end in a ValueError)
        raise job_error("holds a NUL character, which no path can", "write the path without it")
    base = Path(str((info.context or {}).get("job_dir", os.getcwd())))
    return Path(os.path.normpath(base / path))


def list_to_tuple(value: object) -> object:
    """YAML lists become tuples, so that frozen sections hold nothing mutable."""
    return tuple(value) if isinstance(value, list) else value


def _yaml_float(value: object) -> object:
    """A number YAML left as a string -> float; anything else unchanged for the type check."""
    # PyYAML follows YAML 1.1, where `2e-4` (no dot) is a string; people mean the number.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _bytes(value: object) -> object:
    """``24GiB`` / ``64GB`` -> bytes (int); a bare number (``24``) is refused with the fix."""
    if not isinstance(value, (str, int, float)):
        return value  # the int type check reports it
    try:
        return parse_bytes(value, unit_required=True)
    except UnitError as error:
        fix = error.expected if "no unit" in error.reason or "bits" in error.reason else SIZE_HELP
        raise job_error(f"bad byte size: {error.reason}", f"use {fix}") from None


def to_seconds(value: object) -> object:
    """``20m`` / ``1h30m`` / a plain number -> seconds (float). A plain number stays valid (job
    files written that way keep loading); ``jobfile.advice`` warns about it, with the fix."""
    if not isinstance(value, (str, int, float)):
        return value
    try:
        return parse_duration(value)
    except UnitError as error:
        raise job_error(f"bad duration: {error.reason}", f"use {DURATION_HELP}") from None


_UUID_RE = re.compile(r"^(GPU|MIG)-[0-9a-fA-F-]+$")
_DEVICE_HELP = "use auto, cpu, a GPU index (0), cuda:N, or a GPU UUID (GPU-...)"


def _device(value: object) -> object:
    """``0`` / ``cuda:0`` -> ``cuda:0``; ``auto``, ``cpu`` and GPU/MIG UUIDs unchanged."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return f"cuda:{value}"
    if isinstance(value, str):
        text = value.strip()
        if text in ("auto", "cpu") or _UUID_RE.match(text):
            return text
        if re.fullmatch(r"(cuda:)?\d+", text):
            return f"cuda:{text.removeprefix('cuda:')}"
    raise job_error("not a device", _DEVICE_HELP)


def _target_modules(value: object) -> object:
    """``attention`` / ``mlp`` / ``all-linear`` (resolved per architecture, see
    ``trainer_child.contract.targets``) or a non-empty list of module names (as a tuple)."""
    if value in TARGET_KEYWORDS:
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, str) and m for m in value):
        return tuple(value)
    raise job_error(
        "not a list of module names",
        "use attention, mlp, all-linear or a non-empty list such as [q_proj, k_proj, v_proj, o_proj]",
    )


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
    """A mapping of failure kind -> rung names, with tuples for lists."""
    # Keys become FailureKind members where they name one; the others fail the dict key check.
    if not isinstance(value, dict):
        return value
    kinds = {kind.value: kind for kind in FailureKind}
    return {kinds.get(k, k) if isinstance(k, str) else k: list_to_tuple(v) for k, v in value.items()}


def _rung_name(value: str) -> str:
    """A rung name the policies know, else a did-you-mean."""
    if value in RETIRED_RUNGS:
        raise job_error(RETIRED_RUNGS[value], "remove it from the ladder, or name activation_offload")
    if value not in RUNG_NAMES:
        raise job_error("unknown rung", did_you_mean(value, RUNG_NAMES))
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
