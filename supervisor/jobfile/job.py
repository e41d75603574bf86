"""The job file: parsed once, validated completely, frozen.

``load_job(path)`` reads YAML with ``yaml.safe_load`` (tags such as ``!!python/object`` are
refused, never executed) and returns a :class:`Job`, or raises :class:`JobError` carrying
*every* :class:`Problem` at once, each with its field path, the bad value and the fix.

Validation runs in two passes so that one bad section does not hide the others' problems:

1. shape: each section is validated on its own by a frozen pydantic model (types, units,
   ranges, allowed values, unknown keys with a did-you-mean); paths are resolved against the
   job file's directory;
2. world: checks across fields and against the file system (model directories, data files
   and their fields, batch divisibility, the output directory), run for every section that
   passed the first pass.

Nothing after ``load_job`` reads raw dicts: the loop asks the Job for Knobs, specs and seconds.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from qlora_supervise.policies.rungs import RUNG_NAMES
from qlora_supervise.supervisor.jobfile import _data_fields
from qlora_supervise.supervisor.jobfile.units import (
    BYTES_HELP,
    DURATION_HELP,
    UnitError,
    format_bytes,
    format_duration,
    parse_bytes,
    parse_duration,
)
from qlora_supervise.trainer_child.protocol import DataSpec, FailureKind, Knobs, TrainSpec

FILE_PATH = "<job file>"  # the field path of problems with the file as a whole


# --------------------------------------------------------------------------- problems


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a job file. ``got`` is the bad value as shown to people (None: missing)."""

    path: str
    problem: str
    got: str | None
    fix: str

    def render(self) -> str:
        """``  train.micro_batch_size: must be > 0 (got 0; use a value > 0)``"""
        got = "missing" if self.got is None else f"got {self.got}"
        detail = f"{got}; {self.fix}" if self.fix else got
        return f"  {self.path}: {self.problem} ({detail})"


class JobError(Exception):
    """The job file cannot be used; ``problems`` lists every reason at once."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(p.render() for p in problems))
        self.problems = problems


def show(value: object) -> str:
    """A value as the job file would spell it, cut to one short line."""
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, Path):
        text = repr(str(value))
    else:
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def did_you_mean(word: object, choices: Iterable[str], label: str = "allowed") -> str:
    """``did you mean 'micro_batch_size'?`` when one choice is close, else ``allowed: <choices>``."""
    options = sorted(choices)
    close = difflib.get_close_matches(str(word), options, n=1, cutoff=0.6)
    if close:
        return f"did you mean {close[0]!r}?"
    return f"{label}: " + (", ".join(options) or "none")


def _job_error(problem: str, fix: str) -> PydanticCustomError:
    # Custom validators raise this: the problem and its fix travel apart in ctx.
    return PydanticCustomError("job", "{problem}", {"problem": problem, "fix": fix})


# --------------------------------------------------------------------------- field types


def _resolve_path(value: object, info: ValidationInfo) -> object:
    if isinstance(value, Path):
        path = value
    elif isinstance(value, str) and value.strip():
        path = Path(value.strip()).expanduser()
    else:
        raise _job_error("not a path", "write a file or directory path (relative to the job file)")
    base = Path(str((info.context or {}).get("job_dir", os.getcwd())))
    return Path(os.path.normpath(base / path))


def _list_to_tuple(value: object) -> object:
    return tuple(value) if isinstance(value, list) else value


def _yaml_float(value: object) -> object:
    # PyYAML follows YAML 1.1, where `2e-4` (no dot) is a string; people mean the number.
    if isinstance(value, str):
        try:
            return float(value)
        except ValueError:
            return value
    return value


def _bytes(value: object) -> object:
    if not isinstance(value, (str, int, float)):
        return value  # the int type check reports it
    try:
        return parse_bytes(value)
    except UnitError as error:
        raise _job_error(f"bad byte size: {error.reason}", f"use {BYTES_HELP}") from None


def _seconds(value: object) -> object:
    if not isinstance(value, (str, int, float)):
        return value
    try:
        return parse_duration(value)
    except UnitError as error:
        raise _job_error(f"bad duration: {error.reason}", f"use {DURATION_HELP}") from None


_UUID_RE = re.compile(r"^(GPU|MIG)-[0-9a-fA-F-]+$")
_DEVICE_HELP = "use auto, cpu, a GPU index (0), cuda:N, or a GPU UUID (GPU-...)"


def _device(value: object) -> object:
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return f"cuda:{value}"
    if isinstance(value, str):
        text = value.strip()
        if text in ("auto", "cpu") or _UUID_RE.match(text):
            return text
        if re.fullmatch(r"(cuda:)?\d+", text):
            return f"cuda:{text.removeprefix('cuda:')}"
    raise _job_error("not a device", _DEVICE_HELP)


def _target_modules(value: object) -> object:
    if value == "all-linear":
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, str) and m for m in value):
        return tuple(value)
    raise _job_error(
        "not a list of module names",
        "use all-linear or a non-empty list such as [q_proj, k_proj, v_proj, o_proj]",
    )


def _ladders(value: object) -> object:
    if not isinstance(value, dict):
        return value
    kinds = {kind.value: kind for kind in FailureKind}
    return {kinds.get(k, k) if isinstance(k, str) else k: _list_to_tuple(v) for k, v in value.items()}


def _rung_name(value: str) -> str:
    if value not in RUNG_NAMES:
        raise _job_error("unknown rung", did_you_mean(value, RUNG_NAMES))
    return value


ResolvedPath = Annotated[Path, BeforeValidator(_resolve_path)]
Name = Annotated[str, Field(min_length=1)]
PositiveInt = Annotated[int, Field(gt=0)]
Fraction = Annotated[float, BeforeValidator(_yaml_float), Field(ge=0.0, lt=1.0)]
PositiveFloat = Annotated[float, BeforeValidator(_yaml_float), Field(gt=0.0, allow_inf_nan=False)]
ByteSize = Annotated[int, BeforeValidator(_bytes), Field(gt=0)]
Seconds = Annotated[float, BeforeValidator(_seconds), Field(gt=0.0)]
RungName = Annotated[str, AfterValidator(_rung_name)]

Optimizer = Literal["paged_adamw_8bit", "adamw_8bit", "paged_adamw_32bit", "adamw_torch", "adamw_torch_fused"]
Scheduler = Literal["cosine", "linear", "constant", "constant_with_warmup"]
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


# --------------------------------------------------------------------------- sections


class _Section(BaseModel):
    # strict: YAML already gives ints, floats and bools; "8" for an int is a mistake worth naming.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


class ModelSection(_Section):
    path: ResolvedPath
    fallbacks: Annotated[tuple[ResolvedPath, ...], BeforeValidator(_list_to_tuple)] = ()
    trust_remote_code: bool = False


class DataSection(_Section):
    path: ResolvedPath
    text_field: Name | None = "text"
    messages_field: Name | None = None
    eval_path: ResolvedPath | None = None
    eval_fraction: Fraction = 0.0

    @model_validator(mode="before")
    @classmethod
    def _messages_replace_default_text(cls, data: Any) -> Any:
        # text_field defaults to "text" only while messages_field is not given.
        if isinstance(data, dict) and data.get("messages_field") is not None and "text_field" not in data:
            return {**data, "text_field": None}
        return data


class QuantizationSection(_Section):
    load_in_4bit: bool = True
    quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"


class LoraSection(_Section):
    r: PositiveInt = 8
    alpha: PositiveInt = 16
    dropout: Fraction = 0.05
    target_modules: Annotated[tuple[str, ...] | str, BeforeValidator(_target_modules)] = (
        DEFAULT_TARGET_MODULES
    )


class TrainSection(_Section):
    max_seq_len: PositiveInt = 512
    micro_batch_size: PositiveInt = 1
    effective_batch_size: PositiveInt = 16
    gradient_checkpointing: bool = True
    optimizer: Optimizer = "paged_adamw_8bit"
    learning_rate: PositiveFloat = 2.0e-4
    lr_scheduler: Scheduler = "cosine"
    warmup_ratio: Fraction = 0.03
    max_grad_norm: Annotated[float, BeforeValidator(_yaml_float), Field(ge=0.0, allow_inf_nan=False)] = 0.3
    max_steps: PositiveInt | None = None
    epochs: PositiveFloat | None = 1.0
    save_steps: PositiveInt = 50
    logging_steps: PositiveInt = 10
    eval_steps: PositiveInt | None = None
    eval_batch_size: PositiveInt = 1
    packing: bool = False
    seed: Annotated[int, Field(ge=0)] = 42
    merge: bool = False


class ResourcesSection(_Section):
    gpu: Annotated[str, BeforeValidator(_device)] = "auto"
    gpu_memory_limit: ByteSize | None = None
    cpu_memory_limit: ByteSize | None = None


class SuperviseSection(_Section):
    max_attempts: PositiveInt = 8
    hang_timeout: Seconds = 1200.0
    max_no_progress_attempts: PositiveInt = 3
    backoff_initial: Seconds = 2.0
    backoff_max: Seconds = 60.0
    keep_effective_batch: bool = True
    contention_wait: Annotated[float, BeforeValidator(_seconds), Field(ge=0.0)] = 1800.0
    degrade_on_contention: bool = False
    ladders: Annotated[
        dict[FailureKind, tuple[RungName, ...]], BeforeValidator(_ladders), Field(default_factory=dict)
    ]


SECTIONS: Mapping[str, type[_Section]] = {
    "model": ModelSection,
    "data": DataSection,
    "quantization": QuantizationSection,
    "lora": LoraSection,
    "train": TrainSection,
    "resources": ResourcesSection,
    "supervise": SuperviseSection,
}
REQUIRED_SECTIONS = ("model", "data")
TOP_LEVEL_KEYS = frozenset({*SECTIONS, "output_dir"})
DEFAULT_OUTPUT_DIR = "./run"


# --------------------------------------------------------------------------- the job


class Job(BaseModel):
    """A validated job. Paths are absolute; durations are seconds; sizes are bytes."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    job_file: Path
    raw_text: str  # the job as submitted, copied into the run directory
    model: ModelSection
    data: DataSection
    quantization: QuantizationSection
    lora: LoraSection
    train: TrainSection
    resources: ResourcesSection
    supervise: SuperviseSection
    output_dir: Path

    @property
    def job_dir(self) -> Path:
        return self.job_file.parent

    @property
    def grad_accum(self) -> int:
        return self.train.effective_batch_size // self.train.micro_batch_size

    @property
    def eval_enabled(self) -> bool:
        return self.data.eval_path is not None or self.data.eval_fraction > 0

    @property
    def fallback_models(self) -> tuple[str, ...]:
        return tuple(str(p) for p in self.model.fallbacks)

    @property
    def device(self) -> str:
        """``auto``, ``cpu``, ``cuda:N`` or a GPU UUID."""
        return self.resources.gpu

    @property
    def gpu_memory_limit_bytes(self) -> int | None:
        return self.resources.gpu_memory_limit

    @property
    def cpu_memory_limit_bytes(self) -> int | None:
        return self.resources.cpu_memory_limit

    @property
    def hang_timeout_s(self) -> float:
        return self.supervise.hang_timeout

    @property
    def backoff_initial_s(self) -> float:
        return self.supervise.backoff_initial

    @property
    def backoff_max_s(self) -> float:
        return self.supervise.backoff_max

    @property
    def contention_wait_s(self) -> float:
        return self.supervise.contention_wait

    def first_knobs(self) -> Knobs:
        """The knobs of attempt 1, before any rung has changed them."""
        return Knobs(
            model=str(self.model.path),
            micro_batch_size=self.train.micro_batch_size,
            grad_accum=self.grad_accum,
            max_seq_len=self.train.max_seq_len,
            gradient_checkpointing=self.train.gradient_checkpointing,
            optimizer=self.train.optimizer,
            lora_r=self.lora.r,
            lora_alpha=self.lora.alpha,
            quant_type=self.quantization.quant_type,
            double_quant=self.quantization.double_quant,
            load_in_4bit=self.quantization.load_in_4bit,
            eval_batch_size=self.train.eval_batch_size,
            eval_enabled=self.eval_enabled,
        )

    def data_spec(self) -> DataSpec:
        data = self.data
        return DataSpec(
            path=str(data.path),
            text_field=data.text_field,
            messages_field=data.messages_field,
            eval_path=None if data.eval_path is None else str(data.eval_path),
            eval_fraction=data.eval_fraction,
        )

    def train_spec(self) -> TrainSpec:
        """The recipe settings no rung changes. ``max_steps`` is -1 when epochs decide the length."""
        t = self.train
        return TrainSpec(
            learning_rate=t.learning_rate,
            lr_scheduler=t.lr_scheduler,
            warmup_ratio=t.warmup_ratio,
            max_grad_norm=t.max_grad_norm,
            max_steps=-1 if t.max_steps is None else t.max_steps,
            epochs=1.0 if t.epochs is None else float(t.epochs),
            save_steps=t.save_steps,
            logging_steps=t.logging_steps,
            eval_steps=t.eval_steps,
            packing=t.packing,
            seed=t.seed,
            lora_dropout=self.lora.dropout,
            target_modules=self.lora.target_modules,
            compute_dtype=self.quantization.compute_dtype,
            trust_remote_code=self.model.trust_remote_code,
            merge=t.merge,
        )

    def ladder_overrides(self) -> dict[FailureKind, tuple[str, ...]]:
        return dict(self.supervise.ladders)


# --------------------------------------------------------------------------- loading


def load_job(path: str | os.PathLike[str]) -> Job:
    """Read, parse and validate the job file at ``path``. Raises JobError with every problem."""
    job_file = Path(os.path.normpath(Path(path).expanduser().absolute()))
    text = _read_text(job_file)
    raw = _parse_yaml(text)
    problems = [*_duplicate_keys(text), *_top_level_problems(raw)]
    context = {"job_dir": str(job_file.parent)}
    sections: dict[str, _Section] = {}
    bad: set[str] = set()
    for name, section_type in SECTIONS.items():
        section, found, bad_fields = _validate_section(name, section_type, raw, context)
        problems += found
        bad |= bad_fields
        if section is not None:
            sections[name] = section
    output_dir, found = _validate_output_dir(raw.get("output_dir", DEFAULT_OUTPUT_DIR), context)
    problems += found
    problems += _world_problems(sections, output_dir, frozenset(bad))
    if problems:
        raise JobError(problems)
    assert output_dir is not None
    # No problems means every section validated whole; pydantic checks their types once more here.
    return Job(job_file=job_file, raw_text=text, output_dir=output_dir, **sections)  # type: ignore[arg-type]


def _read_text(job_file: Path) -> str:
    try:
        return job_file.read_text(encoding="utf-8")
    except FileNotFoundError:
        fix = "check the path; a job file is YAML with at least model.path and data.path"
        raise JobError([Problem(FILE_PATH, "no such file", show(str(job_file)), fix)]) from None
    except (OSError, UnicodeDecodeError) as error:
        problem = Problem(FILE_PATH, f"cannot read the job file: {error}", show(str(job_file)), "")
        raise JobError([problem]) from None


def _parse_yaml(text: str) -> dict[str, Any]:
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise JobError([_yaml_problem(error, text)]) from None
    if raw is None:
        raise JobError(
            [Problem(FILE_PATH, "the job file is empty", None, "write at least model.path and data.path")]
        )
    if not isinstance(raw, dict):
        fix = "the top level must be a mapping of sections (model:, data:, train:, ...)"
        raise JobError([Problem(FILE_PATH, f"top level is a {_yaml_kind(raw)}", show(raw), fix)])
    return raw


def _yaml_problem(error: yaml.YAMLError, text: str) -> Problem:
    mark = getattr(error, "problem_mark", None)
    where = FILE_PATH if mark is None else f"line {mark.line + 1}, column {mark.column + 1}"
    lines = text.splitlines()
    got = show(lines[mark.line].strip()) if mark is not None and mark.line < len(lines) else None
    detail = str(getattr(error, "problem", None) or error)
    tag_match = re.search(r"constructor for the tag '([^']+)'", detail)
    if tag_match:
        tag = tag_match.group(1).replace("tag:yaml.org,2002:", "!!")
        fix = "remove the tag and write plain values: job files are read with yaml.safe_load"
        return Problem(where, f"YAML tag {tag!r} is not allowed", got, fix)
    return Problem(where, f"YAML syntax error: {detail}", got, "fix the YAML at that line")


def _duplicate_keys(text: str) -> Iterator[Problem]:
    """Keys given twice in one mapping: PyYAML silently keeps the last, which hides edits."""
    # compose() builds nodes only (no objects are constructed): as safe as safe_load.
    stack: list[tuple[str, yaml.Node | None]] = [("", yaml.compose(text, Loader=yaml.SafeLoader))]
    while stack:
        prefix, node = stack.pop()
        if not isinstance(node, yaml.MappingNode):
            continue
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key, line = str(key_node.value), key_node.start_mark.line + 1
            path = f"{prefix}.{key}" if prefix else key
            if key in seen:
                where = f"key given twice (lines {seen[key]} and {line}); YAML keeps only the last"
                yield Problem(path, where, show(key), "merge them into one")
            seen.setdefault(key, line)
            stack.append((path, value_node))


def _yaml_kind(value: object) -> str:
    return {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}.get(
        type(value), type(value).__name__
    )


def _top_level_problems(raw: Mapping[str, Any]) -> list[Problem]:
    problems = []
    for key in raw:
        if key not in TOP_LEVEL_KEYS:
            problems.append(
                Problem(str(key), "unknown key", show(raw[key]), did_you_mean(key, TOP_LEVEL_KEYS))
            )
    for name in REQUIRED_SECTIONS:
        if name not in raw:
            problems.append(Problem(name, "required section is missing", None, f"add {name}: {{path: ...}}"))
    return problems


def _validate_section(
    name: str, section_type: type[_Section], raw: Mapping[str, Any], context: dict[str, str]
) -> tuple[_Section | None, list[Problem], set[str]]:
    """The section (partial when some fields are bad), its problems, and the bad field paths.

    A section with bad fields is validated again without them so that the world checks still
    run for the good ones; checks that involve a bad field are skipped (their defaults would lie).
    """
    if name not in raw and name in REQUIRED_SECTIONS:
        return None, [], {name}  # reported once by _top_level_problems
    value = raw.get(name)
    if value is None:
        value = {}  # `train:` with nothing under it means the defaults
    if not isinstance(value, dict):
        return None, [Problem(name, f"must be a mapping, not a {_yaml_kind(value)}", show(value), "")], {name}
    try:
        return section_type.model_validate(value, context=context), [], set()
    except ValidationError as error:
        problems = _problems_from(error, name, section_type)
        bad_keys = {str(item["loc"][0]) for item in error.errors() if item["loc"]}
    try:
        good = {k: v for k, v in value.items() if k not in bad_keys}
        partial: _Section | None = section_type.model_validate(good, context=context)
    except ValidationError:
        partial = None  # a required field is bad: nothing in this section can be checked
    return partial, problems, {f"{name}.{key}" for key in bad_keys}


def _validate_output_dir(value: object, context: dict[str, str]) -> tuple[Path | None, list[Problem]]:
    try:
        return TypeAdapter(ResolvedPath).validate_python(value, context=context), []
    except ValidationError as error:
        return None, _problems_from(error, "output_dir", None)


# --------------------------------------------------------------------------- pydantic -> problems

_TYPE_NAMES = {
    "int_type": "a whole number",
    "int_from_float": "a whole number",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "tuple_type": "a list",
    "list_type": "a list",
    "dict_type": "a mapping",
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def _problems_from(error: ValidationError, prefix: str, section_type: type[_Section] | None) -> list[Problem]:
    problems = []
    for item in error.errors(include_url=False):
        loc = [str(part) for part in item["loc"]]
        problems.append(_one_problem(item, [prefix, *loc], section_type))
    return problems


def _one_problem(item: Any, loc: list[str], section_type: type[_Section] | None) -> Problem:
    kind, ctx, value = item["type"], item.get("ctx") or {}, item.get("input")
    if loc[-1] == "[key]":  # a dict key (ladders: failure kinds)
        path = ".".join(loc[:-1])
        kinds = tuple(k.value for k in FailureKind)
        return Problem(path, "unknown failure kind", show(value), did_you_mean(value, kinds))
    path = ".".join(loc)
    if kind == "job":
        return Problem(path, str(ctx["problem"]), show(value), str(ctx["fix"]))
    if kind == "extra_forbidden":
        known = frozenset(section_type.model_fields) if section_type and len(loc) == 2 else frozenset()
        return Problem(
            path, "unknown key", show(value), did_you_mean(loc[-1], known) if known else "remove it"
        )
    if kind == "missing":
        return Problem(path, "required key is missing", None, "add it")
    if kind in ("literal_error", "enum"):
        choices = tuple(re.findall(r"'([^']*)'", str(ctx.get("expected", ""))))
        return Problem(path, "not an allowed value", show(value), did_you_mean(value, choices))
    if kind in _BOUNDS:
        op = _BOUNDS[kind]
        bound = next(iter(ctx.values()), "?")
        return Problem(path, f"must be {op} {bound}", show(value), f"use a value {op} {bound}")
    if kind in _TYPE_NAMES:
        return Problem(path, "wrong type", show(value), f"expected {_TYPE_NAMES[kind]}")
    if kind == "string_too_short":
        return Problem(path, "must not be empty", show(value), "write a name")
    if kind == "finite_number":
        return Problem(path, "must be a finite number", show(value), "")
    return Problem(path, str(item["msg"]), show(value), "")


# --------------------------------------------------------------------------- world checks


def _world_problems(
    sections: Mapping[str, _Section], output_dir: Path | None, bad: frozenset[str]
) -> list[Problem]:
    problems: list[Problem] = []
    if isinstance(model := sections.get("model"), ModelSection):
        problems += _model_problems(model, bad)
    if isinstance(data := sections.get("data"), DataSection):
        problems += _data_problems(data, bad)
    if isinstance(train := sections.get("train"), TrainSection):
        problems += _train_problems(train, bad)
        if isinstance(data, DataSection):
            problems += _eval_problems(train, data, bad)
    if isinstance(supervise := sections.get("supervise"), SuperviseSection):
        problems += _supervise_problems(supervise, bad)
    if output_dir is not None:
        problems += _output_dir_problems(output_dir)
    return problems


def _model_problems(model: ModelSection, bad: frozenset[str]) -> list[Problem]:
    paths = [] if "model.path" in bad else [("model.path", model.path)]
    if "model.fallbacks" not in bad:
        paths += [(f"model.fallbacks.{i}", p) for i, p in enumerate(model.fallbacks)]
    return [problem for name, path in paths if (problem := _model_dir_problem(name, path))]


def _model_dir_problem(name: str, path: Path) -> Problem | None:
    if not path.exists():
        return Problem(name, "no such directory", show(path), "give a local model directory")
    if not path.is_dir():
        return Problem(name, "not a directory", show(path), "give the model's directory")
    if not (path / "config.json").is_file():
        fix = "point at a Hugging Face model directory (config.json + weights)"
        return Problem(name, "no config.json in the directory", show(path), fix)
    return None


def _data_problems(data: DataSection, bad: frozenset[str]) -> list[Problem]:
    problems = []
    fields_ok = not bad & {"data.text_field", "data.messages_field"}
    if fields_ok and data.text_field is not None and data.messages_field is not None:
        fix = "set one of them; the other to null"
        problems.append(
            Problem(
                "data.messages_field",
                "both text_field and messages_field are set",
                show(data.messages_field),
                fix,
            )
        )
    if fields_ok and data.text_field is None and data.messages_field is None:
        problems.append(
            Problem("data.text_field", "neither text_field nor messages_field is set", None, "set one")
        )
    if (
        not bad & {"data.eval_path", "data.eval_fraction"}
        and data.eval_path is not None
        and data.eval_fraction > 0
    ):
        fix = "use eval_path or eval_fraction, not both"
        problems.append(
            Problem(
                "data.eval_fraction",
                "both eval_path and eval_fraction are set",
                show(data.eval_fraction),
                fix,
            )
        )
    if "data.path" not in bad:
        problems += _source_problems("data.path", data.path, data, fields_ok)
    if "data.eval_path" not in bad and data.eval_path is not None:
        problems += _source_problems("data.eval_path", data.eval_path, data, fields_ok)
    return problems


def _source_problems(path_name: str, path: Path, data: DataSection, check_fields: bool) -> list[Problem]:
    if not path.exists():
        return [
            Problem(
                path_name,
                "no such file or directory",
                show(path),
                "check the path (relative to the job file)",
            )
        ]
    try:
        found = _data_fields.probe(path)
    except _data_fields.DataProbeError as error:
        return [Problem(path_name, str(error), show(path), f"use {_data_fields.FORMATS_HELP}")]
    if not check_fields:
        return []
    problems = []
    for field_name, field, messages in (
        ("data.text_field", data.text_field, False),
        ("data.messages_field", data.messages_field, True),
    ):
        why = None if field is None else _data_fields.field_problem(found, field, messages=messages)
        if why is not None:
            where = "" if path_name == "data.path" else f" ({path_name})"
            known = field in found.fields
            fix = "fix the data or the field" if known else did_you_mean(field, found.fields, "fields")
            problems.append(Problem(field_name, why + where, show(field), fix))
    return problems


def _train_problems(train: TrainSection, bad: frozenset[str]) -> list[Problem]:
    problems = []
    batch_ok = not bad & {"train.effective_batch_size", "train.micro_batch_size"}
    if batch_ok and train.effective_batch_size % train.micro_batch_size:
        fix = f"make it a multiple of train.micro_batch_size ({train.micro_batch_size})"
        problems.append(
            Problem(
                "train.effective_batch_size",
                "not divisible by micro_batch_size",
                show(train.effective_batch_size),
                fix,
            )
        )
    length_ok = not bad & {"train.max_steps", "train.epochs"}
    if length_ok and train.max_steps is None and train.epochs is None:
        problems.append(
            Problem("train.max_steps", "neither max_steps nor epochs is set", None, "set one of them")
        )
    return problems


def _eval_problems(train: TrainSection, data: DataSection, bad: frozenset[str]) -> list[Problem]:
    if bad & {"train.eval_steps", "data.eval_path", "data.eval_fraction"}:
        return []
    if train.eval_steps is not None and data.eval_path is None and data.eval_fraction == 0:
        fix = "set data.eval_path or data.eval_fraction, or remove eval_steps"
        return [
            Problem(
                "train.eval_steps",
                "evaluation asked for but there is no eval data",
                show(train.eval_steps),
                fix,
            )
        ]
    return []


def _supervise_problems(supervise: SuperviseSection, bad: frozenset[str]) -> list[Problem]:
    if bad & {"supervise.backoff_max", "supervise.backoff_initial"}:
        return []
    if supervise.backoff_max < supervise.backoff_initial:
        fix = f"use at least backoff_initial ({format_duration(supervise.backoff_initial)})"
        got = show(format_duration(supervise.backoff_max))
        return [Problem("supervise.backoff_max", "smaller than backoff_initial", got, fix)]
    return []


def _output_dir_problems(output_dir: Path) -> list[Problem]:
    if output_dir.exists() and not output_dir.is_dir():
        return [
            Problem(
                "output_dir", "exists and is not a directory", show(output_dir), "choose a directory path"
            )
        ]
    existing = output_dir
    while not existing.exists():
        existing = existing.parent
    if not os.access(existing, os.W_OK | os.X_OK):
        return [
            Problem("output_dir", f"{existing} is not writable", show(output_dir), "choose a writable place")
        ]
    return []


# --------------------------------------------------------------------------- the validate command


def validate_command(path: str) -> int:
    """``qlora-supervise validate``: print ``<file>: OK`` and a summary (0), or every problem (2)."""
    try:
        job = load_job(path)
    except JobError as error:
        count = len(error.problems)
        print(f"{path}: {count} problem{'s' if count != 1 else ''}")
        for problem in error.problems:
            print(problem.render())
        return 2
    print(f"{path}: OK")
    for line in summary_lines(job):
        print(f"  {line}")
    return 0


def summary_lines(job: Job) -> list[str]:
    """A few lines a person checks before starting a long run."""
    t = job.train
    model = str(job.model.path)
    if job.model.fallbacks:
        model += f" (fallbacks: {', '.join(job.fallback_models)})"
    length = f"max_steps {t.max_steps}" if t.max_steps is not None else f"{t.epochs:g} epoch(s)"
    limits = [
        f"{name} {format_bytes(n)}"
        for name, n in (("GPU", job.gpu_memory_limit_bytes), ("CPU", job.cpu_memory_limit_bytes))
        if n is not None
    ]
    return [
        f"model: {model}",
        f"data: {_data_summary(job.data)}",
        f"effective batch: {t.effective_batch_size} = micro-batch {t.micro_batch_size} x accumulation "
        f"{job.grad_accum}; seq_len {t.max_seq_len}; {length}",
        f"device: {job.device}" + (f"; memory limits: {', '.join(limits)}" if limits else ""),
        f"output_dir: {job.output_dir}",
    ]


def _data_summary(data: DataSection) -> str:
    field = (
        f"messages_field {data.messages_field!r}"
        if data.messages_field
        else f"text_field {data.text_field!r}"
    )
    try:
        rows = _data_fields.probe(data.path, count_rows=True).rows
    except _data_fields.DataProbeError:
        rows = None
    count = "" if rows is None else f"{rows} rows, "
    return f"{data.path} ({count}{field})"
