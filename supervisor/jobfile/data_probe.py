"""Peek at a training data file's columns without ``datasets`` (or torch), so a wrong ``text_field``
is caught before any attempt starts; :func:`scan_records` streams every record and names the file,
line and field of the first that cannot train. Formats: :data:`FORMATS_HELP`."""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.jobfile.bounds import json_loads
from qlora_supervise.trainer_child.contract.data_rows import DataRowError as DataRowError
from qlora_supervise.trainer_child.contract.data_rows import scan

FORMATS_HELP = ".jsonl, .json, .csv, .parquet, or a directory saved by datasets.save_to_disk"


class DataProbeError(Exception):
    """The data could not be read; the message says why in words for the job's user."""


@dataclass(frozen=True)
class DataProbe:
    """What the first look at a data source found."""

    fields: tuple[str, ...]
    first_record: Mapping[str, Any] | None = None  # None where only the schema was read
    rows: int | None = None  # a saved dataset's, from its dataset_info.json (None: not counted)


def probe(path: Path) -> DataProbe:
    """The columns (and the first record where cheap) of the data at ``path``; DataProbeError when
    the file is unreadable, empty, malformed or of an unknown kind."""
    if path.is_dir():
        return _probe_dir(path)
    suffix = path.suffix.lower()
    try:
        if suffix in _READERS:
            return _READERS[suffix](path)
    except (OSError, UnicodeDecodeError) as error:
        raise DataProbeError(f"cannot read the file: {error}") from error
    raise DataProbeError(f"unknown data format {suffix or '(no suffix)'!r}; use {FORMATS_HELP}")


def scan_records(path: Path, field: str, *, messages: bool) -> int | None:
    """Every record of the data at ``path`` checked; the number of records (None: not countable).
    Raises DataRowError (a ValueError) naming the file, line and field of the first bad record."""
    if not path.is_dir():
        return scan(path, field, messages=messages)
    if (path / "dataset_dict.json").is_file() or (path / "dataset_info.json").is_file():
        return probe(path).rows
    return sum(scan(file, field, messages=messages) for file in _data_files(path))


def _data_files(path: Path) -> list[Path]:
    return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _READERS)


def field_problem(found: DataProbe, field: str, *, messages: bool) -> str | None:
    """Why ``field`` cannot serve as the text (or chat ``messages``) column, or None if it can."""
    if field not in found.fields:
        return f"no field {field!r} in the data"
    if found.first_record is None:
        return None
    value = found.first_record.get(field)
    if not messages:
        kind = type(value).__name__
        return None if isinstance(value, str) else f"field {field!r} of the first record is {kind}, not text"
    if isinstance(value, list) and all(isinstance(t, dict) and "role" in t and "content" in t for t in value):
        return None
    return f"field {field!r} of the first record is not a list of {{role, content}} messages"


def _probe_jsonl(path: Path) -> DataProbe:
    # Bytes, the first record decoded: a bad byte further down is scan_records' to name.
    with path.open("rb") as handle:
        lines = ((number, line) for number, line in enumerate(handle, start=1) if line.strip())
        number, raw = next(lines, (0, b""))
    if not raw:
        raise DataProbeError("the file holds no records")
    try:
        first = json_loads(raw.decode("utf-8"))
    except json.JSONDecodeError as error:
        raise DataProbeError(f"line {number} is not valid JSON: {error.msg}") from error
    if not isinstance(first, dict):
        raise DataProbeError(f"line {number} is a JSON {type(first).__name__}, not an object")
    return DataProbe(tuple(first), first)


def _probe_json(path: Path) -> DataProbe:
    try:
        loaded = json_loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as error:
        if error.msg == "Extra data":  # JSON Lines under a .json name, as `datasets` also accepts
            return _probe_jsonl(path)
        raise DataProbeError(f"not valid JSON at line {error.lineno}: {error.msg}") from error
    if isinstance(loaded, list):
        if not loaded:
            raise DataProbeError("the file holds an empty list")
        if not isinstance(first := loaded[0], dict):
            raise DataProbeError(f"the first item is a JSON {type(first).__name__}, not an object")
        return DataProbe(tuple(first), first)
    if not isinstance(loaded, dict):
        raise DataProbeError(f"the file holds a JSON {type(loaded).__name__}, not records")
    if loaded and all(isinstance(value, list) for value in loaded.values()):  # {"text": [...]}: columnar
        return DataProbe(tuple(loaded), {key: (value[0] if value else None) for key, value in loaded.items()})
    return DataProbe(tuple(loaded), loaded)


def _probe_csv(path: Path) -> DataProbe:
    with path.open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        first = next(reader, None)
        if reader.fieldnames is None:
            raise DataProbeError("the file is empty (no header row)")
        if first is None:
            raise DataProbeError("the file has a header but no records")
    return DataProbe(tuple(reader.fieldnames), dict(first))


def _probe_parquet(path: Path) -> DataProbe:
    try:
        import pyarrow.parquet as pq  # comes with `datasets`; only the schema is read
    except ImportError as error:  # pragma: no cover - pyarrow is a dependency of datasets
        raise DataProbeError("pyarrow is not installed; cannot read parquet") from error
    try:
        parquet = pq.ParquetFile(path)
    except Exception as error:  # pyarrow raises its own ArrowInvalid / OSError kinds
        raise DataProbeError(f"not a readable parquet file: {error}") from error
    return DataProbe(tuple(parquet.schema_arrow.names))


def _probe_dir(path: Path) -> DataProbe:
    if (path / "dataset_dict.json").is_file():  # a saved DatasetDict: its train split, else its first
        splits = _read_json(path / "dataset_dict.json").get("splits") or []
        if not isinstance(splits, list) or not splits:
            raise DataProbeError("dataset_dict.json lists no splits")
        return _probe_dir(path / ("train" if "train" in splits else str(splits[0])))
    if (path / "dataset_info.json").is_file():
        info = _read_json(path / "dataset_info.json")
        if not isinstance(features := info.get("features"), dict):
            raise DataProbeError("dataset_info.json has no features")
        splits = found if isinstance(found := info.get("splits"), dict) else {}
        counts = [split.get("num_examples") for split in splits.values() if isinstance(split, dict)]
        numbers = [count for count in counts if isinstance(count, int)]
        rows = sum(numbers) if numbers and len(numbers) == len(counts) else None
        return DataProbe(tuple(features), None, rows)
    if not (files := _data_files(path)):
        raise DataProbeError(f"the directory holds no dataset (expected {FORMATS_HELP})")
    return probe(files[0])


_READERS: Mapping[str, Callable[[Path], DataProbe]] = {
    ".jsonl": _probe_jsonl,
    ".json": _probe_json,  # parsed whole
    ".csv": _probe_csv,
    ".parquet": _probe_parquet,  # the schema alone
}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        loaded = json_loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataProbeError(f"cannot read {path.name}: {error}") from error
    if not isinstance(loaded, dict):
        raise DataProbeError(f"{path.name} is not a JSON object")
    return loaded
