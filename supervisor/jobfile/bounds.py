"""Bounded YAML input: a size limit before a file is read; depth, value and alias-expansion limits
before it is built (no ``RecursionError``, no minutes spent refusing a 12 MB file). JSON read from
the user's files goes through :func:`json_loads`: too deep is a ``JSONDecodeError`` with words."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import yaml

#: Bytes a job file or a tool's config may hold: a full job file is about 3 KB.
MAX_FILE_BYTES = 256 * 1024
#: Levels of nesting (mappings and lists): a job file needs 3, a tool's config about 5.
MAX_DEPTH = 32
#: Nodes a job file may expand to, aliases counted at each use. A full job file has about 100.
MAX_EXPANDED_NODES = 10_000
_OPEN = (yaml.MappingStartEvent, yaml.SequenceStartEvent)
_CLOSE = (yaml.MappingEndEvent, yaml.SequenceEndEvent)
_VALUE = (yaml.ScalarEvent, yaml.AliasEvent, *_OPEN)


class InputBoundError(ValueError):
    """The input is past a bound: ``why`` says which, ``got`` by how much, ``fix`` what to do."""

    def __init__(self, why: str, got: str, fix: str) -> None:
        super().__init__(f"{why} ({got})")
        self.why, self.got, self.fix = why, got, fix


class AliasBombError(ValueError):
    """The document's aliases expand past :data:`MAX_EXPANDED_NODES` (or refer to themselves)."""


def read_bounded(path: Path) -> str:
    """The UTF-8 text of ``path``; InputBoundError past :data:`MAX_FILE_BYTES` (checked before reading
    a regular file, and by reading one byte past it for a pipe). OSError and UnicodeDecodeError pass."""
    with open(path, "rb") as handle:
        info = os.fstat(handle.fileno())
        if stat.S_ISREG(info.st_mode) and (size := info.st_size) > MAX_FILE_BYTES:
            raise _too_large(f"{size / 1e6:.1f} MB" if size >= 1_000_000 else f"{size} bytes")
        data = handle.read(MAX_FILE_BYTES + 1)
    if len(data) > MAX_FILE_BYTES:
        raise _too_large(f"more than {MAX_FILE_BYTES} bytes")
    return data.decode("utf-8")


def safe_load_bounded(text: str) -> Any:
    """``yaml.safe_load(text)`` once the text is within every bound; raises InputBoundError,
    AliasBombError or yaml.YAMLError. The nesting and the values as written are counted on PyYAML's
    event stream (no recursion), then the nodes the aliases expand to, each use counted: one visit per
    node (memoized), so a "billion laughs" file is refused fast."""
    depth = values = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, _VALUE):
            values += 1
            if values > MAX_EXPANDED_NODES:
                got = f"more than {MAX_EXPANDED_NODES} values; a job file has about 100"
                raise InputBoundError("too many values", got, "keep the file to the settings the run needs")
        if isinstance(event, _OPEN):
            depth += 1
            if depth > MAX_DEPTH:
                where = f" at line {event.start_mark.line + 1}" if event.start_mark else ""
                got = f"more than {MAX_DEPTH} levels{where}"
                fix = "nest mappings and lists a few levels at most, as the examples do"
                raise InputBoundError("nested too deep", got, fix)
        elif isinstance(event, _CLOSE):
            depth -= 1
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()

    def size(node: yaml.Node) -> int:
        if (key := id(node)) in sizes:
            return sizes[key]
        if key in open_nodes:
            raise AliasBombError("an alias refers to a node that contains it (an endless expansion)")
        open_nodes.add(key)
        total = 1
        if isinstance(node, yaml.SequenceNode):
            total += sum(size(item) for item in node.value)
        elif isinstance(node, yaml.MappingNode):
            total += sum(size(k) + size(v) for k, v in node.value)
        open_nodes.discard(key)
        if total > MAX_EXPANDED_NODES:
            raise AliasBombError(f"its aliases expand to more than {MAX_EXPANDED_NODES} values")
        sizes[key] = total
        return total

    if (root := yaml.compose(text, Loader=yaml.SafeLoader)) is not None:
        size(root)
    return yaml.safe_load(text)


def json_loads(text: str | bytes) -> Any:
    """``json.loads``; a value nested past the interpreter's recursion limit is a JSONDecodeError."""
    try:
        return json.loads(text)
    except RecursionError:
        doc = text if isinstance(text, str) else text.decode("utf-8", "replace")
        raise json.JSONDecodeError("nested too deep to read (thousands of levels)", doc[:80], 0) from None


def _too_large(size: str) -> InputBoundError:
    got = f"{size}; the limit is {MAX_FILE_BYTES // 1024} KiB, a job file is a few KB"
    fix = "check that this is the file you meant; write only the settings the run needs"
    return InputBoundError("the file is too large", got, fix)
