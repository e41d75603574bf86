"""``load_job``: read the job file (safe YAML, bounded), validate it in two passes (shape: each section
by its pydantic model; world: checks across fields and against the disk, for what passed), and build
the Job, or raise every problem at once. Pydantic's errors become :class:`Problem` lines."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import TypeAdapter, ValidationError

from qlora_supervise.supervisor.jobfile import bounds, schema
from qlora_supervise.supervisor.jobfile.job import Job, job_from_sections
from qlora_supervise.supervisor.jobfile.problems import (
    FILE_PATH,
    JOB_ERROR_TYPE,
    JobError,
    Problem,
    did_you_mean,
    show,
)
from qlora_supervise.supervisor.jobfile.world import world_problems
from qlora_supervise.trainer_child.contract.codes import FailureKind

_S = TypeVar("_S", bound=schema.Section)
_YAML_KINDS = {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}
_TYPE_NAMES = {
    "a whole number": ("int_type", "int_from_float"),
    "a number": ("float_type",),
    "true or false": ("bool_type",),
    "a string": ("string_type",),
    "a list": ("tuple_type", "list_type"),
    "a mapping": ("dict_type",),
}
#: Pydantic error types whose words do not depend on the error: the problem and the fix.
_FIXED = {
    "missing": ("required key is missing", "add it"),
    "string_too_short": ("must not be empty", "write a name"),
    "finite_number": ("must be a finite number", ""),
    **{kind: ("wrong type", f"expected {name}") for name, kinds in _TYPE_NAMES.items() for kind in kinds},
}
_BOUNDS = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}


def load_job(path: str | os.PathLike[str]) -> Job:
    """Read, parse and validate our own trainer's job file; JobError with every problem."""
    return job_of(*read_job_file(path))


def read_job_file(path: str | os.PathLike[str]) -> tuple[Path, str, dict[str, Any]]:
    """The job file's absolute path, text and top-level mapping; JobError when it is unusable as one."""
    job_file = Path(os.path.normpath(Path(path).expanduser().absolute()))
    try:
        text = bounds.read_bounded(job_file)
        raw = bounds.safe_load_bounded(text)
    except bounds.InputBoundError as error:
        raise JobError([Problem(FILE_PATH, error.why, error.got, error.fix)]) from None
    except FileNotFoundError:
        fix = "check the path; a job file is YAML with at least model.path and data.path"
        raise JobError([Problem(FILE_PATH, "no such file", show(str(job_file)), fix)]) from None
    except yaml.YAMLError as error:
        raise JobError([_yaml_problem(error, text)]) from None
    except bounds.AliasBombError as error:
        fix = "write the values out, or use fewer nested aliases (&name / *name)"
        aliases = sum(isinstance(token, yaml.AliasToken) for token in yaml.scan(text, Loader=yaml.SafeLoader))
        got = f"{aliases} aliases"
        raise JobError([Problem(FILE_PATH, f"YAML aliases refused: {error}", got, fix)]) from None
    except (OSError, UnicodeDecodeError) as error:
        problem = Problem(FILE_PATH, f"cannot read the job file: {error}", show(str(job_file)), "")
        raise JobError([problem]) from None
    if raw is None:
        fix = "write at least model.path and data.path"
        raise JobError([Problem(FILE_PATH, "the job file is empty", None, fix)])
    if not isinstance(raw, dict):
        fix = "the top level must be a mapping of sections (model:, data:, train:, ...)"
        raise JobError([Problem(FILE_PATH, f"top level is a {_yaml_kind(raw)}", show(raw), fix)])
    return job_file, text, raw


def job_of(job_file: Path, text: str, raw: Mapping[str, Any]) -> Job:
    """Our own trainer's Job, or JobError with every problem."""
    problems = [*duplicate_keys(text), *_top_level_problems(raw)]
    context = {"job_dir": str(job_file.parent)}
    sections: dict[str, schema.Section] = {}
    bad: set[str] = set()
    for name, section_type in schema.SECTIONS.items():
        section, bad_fields = validate_section(name, section_type, raw, context, problems)
        bad |= bad_fields
        if section is not None:
            sections[name] = section
    output_dir = validate_output_dir(raw, context, problems)
    problems += world_problems(sections, output_dir, frozenset(bad))
    if problems or output_dir is None:
        raise JobError(problems)
    return job_from_sections(job_file, text, output_dir, sections)


def _yaml_problem(error: yaml.YAMLError, text: str) -> Problem:
    """A YAML error as a Problem at its line and column; refused tags get their own words."""
    mark = getattr(error, "problem_mark", None)
    where = FILE_PATH if mark is None else f"line {mark.line + 1}, column {mark.column + 1}"
    lines = text.splitlines()
    got = show(lines[mark.line].strip()) if mark is not None and mark.line < len(lines) else None
    detail = str(getattr(error, "problem", None) or error)
    if tag_match := re.search(r"constructor for the tag '([^']+)'", detail):
        tag = tag_match.group(1).replace("tag:yaml.org,2002:", "!!")
        fix = "remove the tag and write plain values: job files are read with yaml.safe_load"
        return Problem(where, f"YAML tag {tag!r} is not allowed", got, fix)
    return Problem(where, f"YAML syntax error: {detail}", got, "fix the YAML at that line")


def duplicate_keys(text: str) -> Iterator[Problem]:
    """Keys given twice in one mapping: PyYAML silently keeps the last, which hides edits."""
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
    return _YAML_KINDS.get(type(value), type(value).__name__)


def _top_level_problems(raw: Mapping[str, Any]) -> list[Problem]:
    keys = schema.TOP_LEVEL_KEYS
    unknown = [key for key in raw if key not in keys]
    missing = [name for name in schema.REQUIRED_SECTIONS if name not in raw]
    found = [Problem(str(key), "unknown key", show(raw[key]), did_you_mean(key, keys)) for key in unknown]
    why = "required section is missing"
    return found + [Problem(name, why, None, f"add {name}: {{path: ...}}") for name in missing]


def validate_section(
    name: str, kind: type[_S], raw: Mapping[str, Any], context: dict[str, str], problems: list[Problem]
) -> tuple[_S | None, set[str]]:
    """The section (validated again without its bad fields, so the world checks still run for the
    good ones) and the bad field paths; its problems are appended to ``problems``."""
    if name not in raw and name in schema.REQUIRED_SECTIONS:
        return None, {name}  # reported once by _top_level_problems
    value = raw.get(name)
    value = {} if value is None else value  # `train:` with nothing under it means the defaults
    if not isinstance(value, dict):
        problems.append(Problem(name, f"must be a mapping, not a {_yaml_kind(value)}", show(value), ""))
        return None, {name}
    try:
        return kind.model_validate(value, context=context), set()
    except ValidationError as error:
        problems += _problems_from(error, name, kind.model_fields)
        bad_keys = {str(item["loc"][0]) for item in error.errors() if item["loc"]}
    try:
        good = {k: v for k, v in value.items() if k not in bad_keys}
        partial: _S | None = kind.model_validate(good, context=context)
    except ValidationError:
        partial = None  # a required field is bad: nothing in this section can be checked
    return partial, {f"{name}.{key}" for key in bad_keys}


def validate_output_dir(
    raw: Mapping[str, Any], context: dict[str, str], problems: list[Problem]
) -> Path | None:
    """``output_dir`` (default ``./run``) as an absolute path; its problems appended to ``problems``."""
    value = raw.get("output_dir", schema.DEFAULT_OUTPUT_DIR)
    try:
        return TypeAdapter(schema.ResolvedPath).validate_python(value, context=context)
    except ValidationError as error:
        problems += _problems_from(error, "output_dir", ())
        return None


def _problems_from(error: ValidationError, prefix: str, fields: Iterable[str]) -> list[Problem]:
    items = error.errors(include_url=False)
    return [_one_problem(item, [prefix, *map(str, item["loc"])], fields) for item in items]


def _one_problem(item: Any, loc: list[str], fields: Iterable[str]) -> Problem:
    """One pydantic error item (``loc`` already prefixed) in the job file's words."""
    kind, ctx, value = item["type"], item.get("ctx") or {}, item.get("input")
    if loc[-1] == "[key]":  # a dict key (ladders: failure kinds)
        kinds = tuple(k.value for k in FailureKind)
        return Problem(".".join(loc[:-1]), "unknown failure kind", show(value), did_you_mean(value, kinds))
    path = ".".join(loc)
    if kind == JOB_ERROR_TYPE:
        return Problem(path, str(ctx["problem"]), show(value), str(ctx["fix"]))
    if kind == "extra_forbidden":
        known = frozenset(fields) if len(loc) == 2 else frozenset()
        fix = did_you_mean(loc[-1], known) if known else "remove it"
        return Problem(path, "unknown key", show(value), fix)
    if kind in ("literal_error", "enum"):
        choices = tuple(re.findall(r"'([^']*)'", str(ctx.get("expected", ""))))
        return Problem(path, "not an allowed value", show(value), did_you_mean(value, choices))
    if kind in _BOUNDS:
        op, bound = _BOUNDS[kind], next(iter(ctx.values()), "?")
        return Problem(path, f"must be {op} {bound}", show(value), f"use a value {op} {bound}")
    if kind in _FIXED:
        return Problem(path, _FIXED[kind][0], None if kind == "missing" else show(value), _FIXED[kind][1])
    return Problem(path, str(item["msg"]), show(value), "")
