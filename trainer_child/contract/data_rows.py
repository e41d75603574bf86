"""Every record of a data file checked, streamed: the first bad one is named by file, line, field
(``data.jsonl line 4812, field 'text': null, expected text``), the same from ``validate`` and from
the child when ``datasets`` fails. A record holds a string text field, or a messages field of
``{role, content}`` strings; blank JSON Lines are skipped, and the count is of records."""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class DataRowError(ValueError):
    """A record that cannot train: ``where`` is ``line N`` or ``record N``; ``field`` may be None."""

    def __init__(self, path: Path, where: str, field: str | None, problem: str) -> None:
        self.path, self.where, self.field, self.problem = path, where, field, problem
        super().__init__(f"{path.name} {where}" + (f", field {field!r}" if field else "") + f": {problem}")


def scan(path: Path, field: str, *, messages: bool) -> int:
    """The number of records in the file at ``path``, each checked; raises DataRowError."""
    if (suffix := path.suffix.lower()) in (".jsonl", ".csv"):
        return _count((_jsonl_records if suffix == ".jsonl" else _csv_records)(path), path, field, messages)
    if suffix == ".json":
        return _scan_json(path, field, messages)
    if suffix == ".parquet":
        return _scan_parquet(path, field)
    raise DataRowError(path, "as a whole", None, f"unknown data format {suffix!r}")


def record_problem(value: Any, *, messages: bool) -> str | None:
    """Why ``value`` (one record's field) cannot train, or None."""
    if value is None:
        return "null, expected " + ("a list of {role, content} messages" if messages else "text")
    if not messages:
        return None if isinstance(value, str) else f"{_kind(value)}, expected text"
    if not isinstance(value, list):
        return f"{_kind(value)}, expected a list of {{role, content}} messages"
    for number, turn in enumerate(value):
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str):
            return f"message {number} has no string 'role'"
        if not isinstance(turn.get("content"), str):
            return f"message {number} has no string 'content'"
    return None


def _count(records: Iterator[tuple[str, Any]], path: Path, field: str, messages: bool) -> int:
    count = 0
    for where, record in records:
        if not isinstance(record, dict):
            raise DataRowError(path, where, None, f"a JSON {_kind(record)}, expected an object")
        if field not in record:
            raise DataRowError(path, where, field, f"missing (the record has {sorted(record)})")
        if (problem := record_problem(record[field], messages=messages)) is not None:
            raise DataRowError(path, where, field, problem)
        count += 1
    return count


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of each line, decoded one at a time so a bad byte is placed exactly."""
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                bad = raw[exc.start : exc.start + 1].hex()
                problem = f"not UTF-8 (byte 0x{bad} at column {exc.start + 1})"
                raise DataRowError(path, f"line {number}", None, problem) from None


_TOO_DEEP = "not readable: a value nested thousands of levels deep"


def _jsonl_records(path: Path) -> Iterator[tuple[str, Any]]:
    for number, text in _lines(path):
        if not text.strip():
            continue
        where = f"line {number}"
        try:
            yield where, json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataRowError(path, where, None, f"not valid JSON: {exc.msg} (column {exc.colno})") from None
        except RecursionError:  # json's decoder recurses: thousands of levels end it
            raise DataRowError(path, where, None, _TOO_DEEP) from None


def _csv_records(path: Path) -> Iterator[tuple[str, Any]]:
    # A quoted field may span lines: the record is named by the line it starts on.
    reader = csv.DictReader(text for _, text in _lines(path))
    start = 2
    for row in reader:
        yield f"line {start}", {key: value for key, value in row.items() if key is not None}
        start = reader.line_num + 1


def _scan_json(path: Path, field: str, messages: bool) -> int:
    # One JSON value, parsed whole; JSON Lines under a .json name (`datasets` takes it) is streamed.
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise DataRowError(path, f"line {line}", None, "not UTF-8") from None
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":
            return _count(_jsonl_records(path), path, field, messages)
        raise DataRowError(path, f"line {exc.lineno}", None, f"not valid JSON: {exc.msg}") from None
    except RecursionError:
        raise DataRowError(path, "line 1", None, _TOO_DEEP) from None
    if isinstance(loaded, list):
        return _count(((f"record {i + 1}", r) for i, r in enumerate(loaded)), path, field, messages)
    if isinstance(loaded, dict) and loaded and all(isinstance(v, list) for v in loaded.values()):
        if (column := loaded.get(field)) is None:
            raise DataRowError(path, "as a whole", field, f"missing (the columns are {sorted(loaded)})")
        rows = ((f"record {i + 1}", {field: value}) for i, value in enumerate(column))
        return _count(rows, path, field, messages)
    return _count(iter([("record 1", loaded)]), path, field, messages)


def _scan_parquet(path: Path, field: str) -> int:
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = pq.ParquetFile(path)
    names = parquet.schema_arrow.names
    if field not in names:
        raise DataRowError(path, "as a whole", field, f"missing (the columns are {names})")
    kind = parquet.schema_arrow.field(field).type
    count = 0
    for batch in parquet.iter_batches(columns=[field]):
        column = batch.column(0)
        if column.null_count:
            first = next(i for i, value in enumerate(column.to_pylist()) if value is None)
            raise DataRowError(path, f"row {count + first + 1}", field, "null")
        count += len(column)
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_list(kind)):
        raise DataRowError(path, "as a whole", field, f"column of type {kind}, expected text")
    return count


def _kind(value: Any) -> str:
    names = {bool: "boolean", int: "number", float: "number", str: "string", list: "list", dict: "object"}
    return names.get(type(value), type(value).__name__)
