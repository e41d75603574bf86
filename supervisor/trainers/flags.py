"""An HfArgumentParser script's flags as a config (``--per_device_train_batch_size 4`` reads as
``{"per_device_train_batch_size": 4}``) and back; arguments that are not ``--key`` flags are kept."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
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
        with contextlib.suppress(ValueError):
            return number(text)
    try:
        return safe_load_bounded(text)  # a flag's value nested 600 deep is a string, not a crash
    except (yaml.YAMLError, InputBoundError, AliasBombError):
        return text


def _is_flag(arg: str) -> bool:
    return arg.startswith("--") and len(arg) > 2


def _words(argv: Sequence[str]) -> Iterator[tuple[str | None, list[str]]]:
    """Each argument of ``argv`` with its key: a flag with the value word it takes (``--key value``;
    ``--key=value`` and a bare ``--key`` take none), or None and the one word that is no flag."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        takes = _is_flag(arg) and "=" not in arg and i + 1 < len(argv) and not _is_flag(argv[i + 1])
        words = list(argv[i : i + 1 + takes])
        i += len(words)
        yield (arg[2:].partition("=")[0] if _is_flag(arg) else None), words


def parse(argv: Sequence[str]) -> tuple[dict[str, Any], list[Problem]]:
    """The ``--key value`` / ``--key=value`` / bare ``--key`` (true) flags of ``argv``."""
    config: dict[str, Any] = {}
    problems = []
    for key, words in _words(argv):
        if key is None:
            continue
        _, eq, inline = words[0].partition("=")
        value = _value(inline) if eq else _value(words[1]) if len(words) == 2 else True
        if key in config:
            problems.append(Problem(f"trainer.command: --{key}", "given twice", show(value), "keep one"))
        config[key] = value
    return config, problems


def _spelled(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def with_flags(argv: Sequence[str], changes: Mapping[str, Any]) -> list[str]:
    """``argv`` with each ``--key`` of ``changes`` set (None: removed) where the user wrote it, else added."""
    out: list[str] = []
    for key, words in _words(argv):
        if key is None or key not in changes:
            out += words
        elif changes[key] is not None:
            out += [f"--{key}", _spelled(changes[key])]
    written = {key for key, _ in _words(argv)}
    for key, value in changes.items():
        if key not in written and value is not None:
            out += [f"--{key}", _spelled(value)]
    return out
