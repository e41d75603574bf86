"""An HfArgumentParser script's flags as a config (``--per_device_train_batch_size 4`` reads as
``{"per_device_train_batch_size": 4}``) and back; arguments that are not ``--key`` flags are kept."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from qlora_supervise.supervisor.jobfile.bounds import AliasBombError, InputBoundError, safe_load_bounded
from qlora_supervise.supervisor.jobfile.problems import Problem, show

#: Words YAML 1.1 reads as bools that argparse leaves as strings: HfArgumentParser gives a str
#: field ``--save_strategy no`` the word, and a bool field converts it itself.
_WORDS = frozenset({"yes", "no", "on", "off"})


def _value(text: str) -> Any:
    if text.lower() in _WORDS:
        return text
    for number in (int, float):  # PyYAML reads 3e-4 as a string (YAML 1.1); argparse's float would not
        try:
            return number(text)
        except ValueError:
            pass
    try:
        return safe_load_bounded(text)  # a flag's value nested 600 deep is a string, not a crash
    except (yaml.YAMLError, InputBoundError, AliasBombError):
        return text


def _is_flag(arg: str) -> bool:
    return arg.startswith("--") and len(arg) > 2


def parse(argv: Sequence[str]) -> tuple[dict[str, Any], list[Problem]]:
    """The ``--key value`` / ``--key=value`` / bare ``--key`` (true) flags of ``argv``."""
    config: dict[str, Any] = {}
    problems = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        if not _is_flag(arg):
            continue
        key, eq, inline = arg[2:].partition("=")
        if eq:
            value: Any = _value(inline)
        elif i < len(argv) and not _is_flag(argv[i]):
            value, i = _value(argv[i]), i + 1
        else:
            value = True
        if key in config:
            problems.append(Problem(f"trainer.command: --{key}", "given twice", show(value), "keep one"))
        config[key] = value
    return config, problems


def _spelled(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def with_flags(argv: Sequence[str], changes: Mapping[str, Any]) -> list[str]:
    """``argv`` with each ``--key`` of ``changes`` set to its value (None: the flag removed),
    in place where the user wrote it, appended where they did not."""
    out: list[str] = []
    done: set[str] = set()
    i = 0
    while i < len(argv):
        arg = argv[i]
        i += 1
        key = arg[2:].partition("=")[0] if _is_flag(arg) else None
        if key is None or key not in changes:
            out.append(arg)
            continue
        if "=" not in arg and i < len(argv) and not _is_flag(argv[i]):
            i += 1  # its value goes with it
        if changes[key] is not None:
            out += [f"--{key}", _spelled(changes[key])]
        done.add(key)
    for key, value in changes.items():
        if key not in done and value is not None:
            out += [f"--{key}", _spelled(value)]
    return out
