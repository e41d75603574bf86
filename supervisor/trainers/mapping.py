"""The knobs of a tool's config, the config of an attempt's knobs, and what is wrong with a config.
Keys may be dotted for a nested value (``bnb_config_kwargs.bnb_4bit_quant_type``); only the rows of
the table are read or written, every other key passes through untouched."""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

from qlora_supervise.supervisor.jobfile.problems import Problem, show
from qlora_supervise.supervisor.trainers.tool import Config, Row, Table, settable, writable
from qlora_supervise.trainer_child.contract.spec import Knobs

_MISSING = object()
_KNOB_TYPES = {f.name: type(f.default) for f in dataclasses.fields(Knobs) if f.name != "model"}


def lookup(config: Mapping[str, Any], key: str) -> Any:
    """The value at dotted ``key``, or ``_MISSING``."""
    value: Any = config
    for part in key.split("."):
        if not isinstance(value, Mapping) or part not in value:
            return _MISSING
        value = value[part]
    return value


def present(value: Any) -> bool:
    """Whether ``value`` (from :func:`lookup`) is one the config holds (not missing, not null)."""
    return value is not _MISSING and value is not None


def assign(config: dict[str, Any], key: str, value: Any) -> None:
    """Set dotted ``key`` (making the mappings on the way); a None value removes the key."""
    *parents, last = key.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value


def _read(row: Row, value: Any, quoted_numbers: bool) -> Any:
    """The knob's value of the tool's ``value``; "4" is 4 for a tool that reads it so (``quoted_numbers``)."""
    whole = _KNOB_TYPES.get(row.knob) is int
    if quoted_numbers and whole and isinstance(value, str) and value.strip().isdecimal():
        value = int(value)
    return row.read(value)


def knobs_from(table: Table, config: Mapping[str, Any]) -> Knobs:
    """The knobs the tool would train with (its config's values, else its defaults); config_problems first."""
    values: dict[str, Any] = {}
    for row in table.rows:
        value = lookup(config, row.key_in(config))
        if value is _MISSING or value is None:  # the default is in the tool's spelling too
            value = row.default(config) if callable(row.default) else row.default
        values[row.knob] = _read(row, value, table.reads_quoted_numbers)
    values["model"] = str(values.get("model") or "")
    return Knobs(**values)


def config_problems(table: Table, config: Mapping[str, Any], where: str) -> list[Problem]:
    """Missing required keys, knob values of the wrong type, and keys that contradict the ladder."""
    missing = [(key, fix) for key, fix in table.required.items() if lookup(config, key) is _MISSING]
    problems = [Problem(f"{where}: {key}", "required key is missing", None, fix) for key, fix in missing]
    for row in table.rows:
        key = row.key_in(config)
        if not present(raw := lookup(config, key)) or row.knob not in _KNOB_TYPES:
            continue
        value = _read(row, raw, table.reads_quoted_numbers)
        wanted = _KNOB_TYPES[row.knob]
        why, fix = None, ""
        if wanted is int and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            why, fix = "must be a whole number > 0", "write it as 1, 2, 4, ..."
        elif wanted is not int and not isinstance(value, wanted):
            why = f"wrong type: expected a {wanted.__name__}"
        if why is not None:
            problems.append(Problem(f"{where}: {key}", why, show(raw), fix))
    for rule in table.contradictions:
        value = lookup(config, rule.key)
        if value is not _MISSING and rule.bad(value) and rule.given(config):
            problems.append(Problem(f"{where}: {rule.key}", rule.problem, show(value), rule.fix))
    return problems


def attempt_config(
    table: Table, config: Config, job: Knobs, knobs: Knobs, output_dir: str, resume_from: str | None
) -> dict[str, Any]:
    """The user's config with what the ladder changed (``job`` -> ``knobs``, and a row's ``off_with``
    keys with a knob turned off), the tool's output dir and the checkpoint to resume from; every
    other key exactly as the user wrote it."""
    out = copy.deepcopy(dict(config))
    before, after = dataclasses.asdict(job), dataclasses.asdict(knobs)
    for row in table.rows:
        if before[row.knob] != after[row.knob] and writable(row, config):
            # The spelling the tool reads, and a deprecated alias beside it (one value, not two).
            for key in dict.fromkeys([row.key_in(config), *([row.key] if row.key in config else [])]):
                assign(out, key, row.write(after[row.knob]))
            for key in row.off_with if not after[row.knob] else ():
                if present(lookup(config, key)):  # recorded in the attempt's diff like the knob
                    assign(out, key, False)
    assign(out, table.output_key, output_dir)
    assign(out, table.resume_key, resume_from)
    return out


def unmapped_changes(table: Table, config: Mapping[str, Any], job: Knobs, knobs: Knobs) -> list[str]:
    """Knobs that differ from the job's but have no key in this tool (the ladder must not get here)."""
    before, after = dataclasses.asdict(job), dataclasses.asdict(knobs)
    mapped = settable(table, config)
    return [name for name in before if before[name] != after[name] and name not in mapped]


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        nested = isinstance(value, Mapping) and value
        flat.update(flatten(value, f"{prefix}{key}.") if nested else {f"{prefix}{key}": value})
    return flat


def config_diff(user: Mapping[str, Any], attempt: Mapping[str, Any]) -> list[str]:
    """``key: old -> new`` for each key the attempt's config sets differently from the user's."""
    old, new = flatten(user), flatten(attempt)
    lines = []
    for key in dict.fromkeys([*old, *new]):
        a, b = old.get(key, _MISSING), new.get(key, _MISSING)
        if a != b and not (None in (a, b) and _MISSING in (a, b)):  # null and left out: the same
            shown_a = "(absent)" if a is _MISSING else show(a)
            shown_b = "(removed)" if b is _MISSING else show(b)
            lines.append(f"{key}: {shown_a} -> {shown_b}")
    return lines
