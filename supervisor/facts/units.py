"""Durations as people write them in job files (``20m``, ``1h30m``), and the command line's memory
sizes; byte sizes live in the child's contract (``byte_sizes``), re-exported here."""

from __future__ import annotations

import math
import re

from qlora_supervise.trainer_child.contract.byte_sizes import UnitError as UnitError
from qlora_supervise.trainer_child.contract.byte_sizes import format_bytes as format_bytes
from qlora_supervise.trainer_child.contract.byte_sizes import parse_bytes as parse_bytes

DURATION_UNITS: dict[str, float] = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
#: The job file's form: a unit is required (see :func:`parse_bytes`).
SIZE_HELP = "a number with a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 24GiB)"
DURATION_HELP = "seconds, or numbers with units s, m, h, d (e.g. 90s, 20m, 1h30m)"
_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_DURATION_PART_RE = re.compile(rf"({_NUMBER})\s*([smhd])", re.IGNORECASE)
_DURATION_RE = re.compile(rf"^\s*(?:{_NUMBER}\s*[smhd]\s*)+$", re.IGNORECASE)
#: The smallest memory size that is not surely a slip (a bare ``24`` meant as 24 GiB is 24 bytes).
MIN_MEMORY_SIZE = 1024**2


def parse_memory_size(value: str) -> int:
    """A command line's memory size: :func:`parse_bytes`, refusing less than :data:`MIN_MEMORY_SIZE`."""
    if (size := parse_bytes(value)) >= MIN_MEMORY_SIZE:
        return size
    text = str(value).strip()
    number = re.match(_NUMBER, text)
    shown = number.group(0) if number else text
    bare = "" if number is None or number.group(0) != text else " (a number without a unit is bytes)"
    why = f"{text} is {size} bytes{bare}, not a plausible memory size"
    raise UnitError(why, f"a number with a unit, e.g. {shown}GiB or {shown}MiB")


def parse_duration(value: str | int | float) -> float:
    """``"20m"`` -> 1200.0 seconds; ``"1h30m"`` -> 5400.0; plain numbers are seconds. Raises
    UnitError (a ValueError) for anything else, negative numbers included."""
    if isinstance(value, bool):
        raise UnitError("a boolean is not a duration", DURATION_HELP)
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise UnitError("must be a finite number >= 0", DURATION_HELP)
        return float(value)
    text = value.strip()
    if re.fullmatch(_NUMBER, text):
        return float(text)
    if not _DURATION_RE.match(text):
        raise UnitError("not a number with units s, m, h or d", DURATION_HELP)
    return sum(float(n) * DURATION_UNITS[u.lower()] for n, u in _DURATION_PART_RE.findall(text))


def format_duration(seconds: float) -> str:
    """1200.0 -> ``"20m"``; 5400.0 -> ``"1h30m"``; 2.5 -> ``"2.5s"``."""
    if seconds < 60:
        return f"{seconds:g}s"
    parts: list[str] = []
    rest = seconds
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        count, rest = divmod(rest, size)
        if count:
            parts.append(f"{int(count)}{unit}")
    if rest:
        parts.append(f"{rest:g}s")
    return "".join(parts)
