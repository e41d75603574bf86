"""Byte sizes and durations as people write them in job files: ``24GiB``, ``500MB``, ``20m``.

Decimal units (KB, MB, GB, TB) are powers of 1000 and binary units (KiB, MiB, GiB, TiB)
powers of 1024, as their names say. ``24GB`` is therefore 24 * 10**9 bytes (22.35 GiB): when a
memory cap is written in GB the cap comes out a little tighter, never looser. Unit letters are
matched case-insensitively; single letters (``24G``) are refused because they are ambiguous, and
a capital prefix with a small ``b`` (``12Gb``, ``12Gib``) is refused as bits, with the byte form.
"""

from __future__ import annotations

import math
import re

BYTE_UNITS: dict[str, int] = {
    "b": 1,
    "byte": 1,
    "bytes": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}

DURATION_UNITS: dict[str, float] = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}

BYTES_HELP = "a byte count or a number with a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 24GiB)"
#: The job file's form: a unit is required (see :func:`parse_bytes`).
SIZE_HELP = "a number with a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 24GiB)"
DURATION_HELP = "seconds, or numbers with units s, m, h, d (e.g. 90s, 20m, 1h30m)"


class UnitError(ValueError):
    """A value that is not a size or a duration. ``reason`` is the short why; str() adds the forms."""

    def __init__(self, reason: str, expected: str) -> None:
        super().__init__(f"{reason}; expected {expected}")
        self.reason = reason
        self.expected = expected


_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_BYTES_RE = re.compile(rf"^\s*({_NUMBER})\s*([a-z]*)\s*$", re.IGNORECASE)
_DURATION_PART_RE = re.compile(rf"({_NUMBER})\s*([smhd])", re.IGNORECASE)
_DURATION_RE = re.compile(rf"^\s*(?:{_NUMBER}\s*[smhd]\s*)+$", re.IGNORECASE)


def parse_bytes(value: str | int | float, *, unit_required: bool = False) -> int:
    """``"24GiB"`` -> 25769803776. Plain numbers are bytes. Raises UnitError (a ValueError).

    Bools are refused (YAML turns ``yes`` into True). Fractions of a byte are rounded down.
    With ``unit_required`` a number without a unit (``24``, ``"24"``) is refused, except 0:
    in a job file ``gpu_memory_limit: 24`` almost always means 24 GiB, not 24 bytes, and a
    cap read as 24 bytes fails only at run time. The error names the fix (``24GiB``).
    """
    if isinstance(value, bool):
        raise UnitError("a boolean is not a size", BYTES_HELP)
    if unit_required:
        _refuse_bare_number(value)
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise UnitError("must be a finite number >= 0", BYTES_HELP)
        return int(value)
    match = _BYTES_RE.match(value)
    if match is None:
        raise UnitError("not a number with a unit", BYTES_HELP)
    number, unit = match.groups()
    if unit and unit.endswith("b") and any(c.isupper() for c in unit[:-1]):
        # A capital prefix with a small b (Gb, Mb, Gib) is the usual spelling of bits.
        raise UnitError(f"{unit!r} means bits (a small b)", f"{number}{unit[:-1]}B for bytes")
    factor = BYTE_UNITS.get(unit.lower() if unit else "b")
    if factor is None:
        raise UnitError(f"unknown unit {unit!r}", BYTES_HELP)
    return int(float(number) * factor)


#: The smallest memory size (of a card, a cap) that is not surely a slip: a bare ``24`` meant as
#: 24 GiB would be 24 bytes, and a plan or a cap from it is nonsense.
MIN_MEMORY_SIZE = 1024**2


def parse_memory_size(value: str) -> int:
    """A memory size given on the command line (``plan --gpu-memory``): :func:`parse_bytes`, and
    anything below :data:`MIN_MEMORY_SIZE` refused, the fix naming the GiB it surely meant."""
    size = parse_bytes(value)
    if size >= MIN_MEMORY_SIZE:
        return size
    text = str(value).strip()
    number = re.match(_NUMBER, text)
    shown = number.group(0) if number else text
    bare = "" if number is None or number.group(0) != text else " (a number without a unit is bytes)"
    raise UnitError(
        f"{text} is {size} bytes{bare}, not a plausible memory size",
        f"a number with a unit, e.g. {shown}GiB or {shown}MiB",
    )


def _refuse_bare_number(value: str | int | float) -> None:
    """UnitError for a number without a unit (0 aside: it is 0 in every unit)."""
    text = str(value).strip()
    if not re.fullmatch(_NUMBER, text) or float(text) == 0:
        return
    raise UnitError(
        f"{text} has no unit (it would be read as {text} bytes)",
        f"a number with a unit, e.g. {text}GiB or {text}MiB (or {text}B for bytes)",
    )


def parse_duration(value: str | int | float) -> float:
    """``"20m"`` -> 1200.0 seconds; ``"1h30m"`` -> 5400.0; plain numbers are seconds.

    Raises UnitError (a ValueError) for anything else, negative numbers included.
    """
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


def format_bytes(n: int | float) -> str:
    """1610612736 -> ``"1.50 GiB"``; below 1 KiB: ``"512 B"``. Binary units, two decimals."""
    sign = "-" if n < 0 else ""
    size = float(abs(n))
    if size < 1024:
        return f"{sign}{int(size)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{sign}{size:.2f} {unit}"


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
