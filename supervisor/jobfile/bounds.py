"""Bounded YAML input: a size limit before a file is read, a depth and a value limit before it is built.

A job file is a few KB and a tool's config not much more, but either may be anything a user (or a
generator gone wrong) wrote. Unbounded, a 12 MB file took minutes and a GB to refuse, and a value
nested 600 levels deep ended the supervisor in a ``RecursionError`` (PyYAML builds nodes
recursively). So, in this order, each refusal a :class:`InputBoundError` with its words:

1. the file's size: at most :data:`MAX_FILE_BYTES`, checked on the open file (``fstat``) and read
   at most one byte past it (a pipe or a device has no size);
2. the nesting and the count of values, on PyYAML's event stream (an iterative parser: no
   recursion, memory bounded by the text): at most :data:`MAX_DEPTH` levels and
   :data:`~.aliases.MAX_EXPANDED_NODES` values as written;
3. the expansion of aliases, on the composed node graph (:mod:`.aliases`);

and only then the values are built with ``yaml.safe_load``. JSON the supervisor reads from the
user's files (data records, a model's ``config.json`` and safetensors header, a tool's
``dataset_info.json``) goes through :func:`json_loads`: Python's decoder recurses too, and a value
nested past its limit is a ``JSONDecodeError`` with words, like any other bad JSON.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import yaml

from qlora_supervise.supervisor.jobfile.aliases import MAX_EXPANDED_NODES, check_expansion

#: Bytes a job file or a tool's config may hold: a full job file is about 3 KB.
MAX_FILE_BYTES = 256 * 1024
#: Levels of nesting (mappings and lists): a job file needs 3, a tool's config about 5.
MAX_DEPTH = 32
_OPEN = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSE = (yaml.MappingEndEvent, yaml.SequenceEndEvent)
_VALUE = (yaml.ScalarEvent, yaml.AliasEvent, *_OPEN)


class InputBoundError(ValueError):
    """The input is past a bound: ``why`` says which, ``got`` by how much, ``fix`` what to do."""

    def __init__(self, why: str, got: str, fix: str) -> None:
        super().__init__(f"{why} ({got})")
        self.why = why
        self.got = got
        self.fix = fix


def read_bounded(path: Path, limit: int = MAX_FILE_BYTES) -> str:
    """The UTF-8 text of ``path``; InputBoundError past ``limit`` bytes (before reading a large file).

    OSError and UnicodeDecodeError pass through to the caller, which words them.
    """
    with open(path, "rb") as handle:
        info = os.fstat(handle.fileno())
        if stat.S_ISREG(info.st_mode) and info.st_size > limit:
            raise _too_large(_size(info.st_size), limit)
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise _too_large(f"more than {limit} bytes", limit)
    return data.decode("utf-8")


def check_shape(text: str, max_depth: int = MAX_DEPTH, max_values: int = MAX_EXPANDED_NODES) -> None:
    """InputBoundError when ``text`` nests deeper than ``max_depth`` or holds more than ``max_values``
    values as written; yaml.YAMLError when it is no YAML (the caller words it at its line)."""
    depth = values = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, _VALUE):
            values += 1
            if values > max_values:
                got = f"more than {max_values} values; a job file has about 100"
                raise InputBoundError("too many values", got, "keep the file to the settings the run needs")
        if isinstance(event, _OPEN):
            depth += 1
            if depth > max_depth:
                where = f" at line {event.start_mark.line + 1}" if event.start_mark else ""
                got = f"more than {max_depth} levels{where}"
                fix = "nest mappings and lists a few levels at most, as the examples do"
                raise InputBoundError("nested too deep", got, fix)
        elif isinstance(event, _CLOSE):
            depth -= 1


def safe_load_bounded(text: str) -> Any:
    """``yaml.safe_load(text)`` once the text is within every bound (see the module's docstring).

    Raises InputBoundError, AliasBombError (from :mod:`.aliases`) or yaml.YAMLError.
    """
    check_shape(text)
    check_expansion(yaml.compose(text, Loader=yaml.SafeLoader))
    return yaml.safe_load(text)


def json_loads(text: str | bytes) -> Any:
    """``json.loads``; a value nested past the interpreter's recursion limit is a JSONDecodeError."""
    try:
        return json.loads(text)
    except RecursionError:
        doc = text if isinstance(text, str) else text.decode("utf-8", "replace")
        raise json.JSONDecodeError("nested too deep to read (thousands of levels)", doc[:80], 0) from None


def _too_large(size: str, limit: int) -> InputBoundError:
    got = f"{size}; the limit is {limit // 1024} KiB, a job file is a few KB"
    fix = "check that this is the file you meant; write only the settings the run needs"
    return InputBoundError("the file is too large", got, fix)


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1_000_000 else f"{n} bytes"
