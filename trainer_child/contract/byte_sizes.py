"""Byte sizes, parsed and formatted in one place for both sides: ``24GiB``, ``500MB``, ``1.50 GiB``. KB..TB
are powers of 1000, KiB..TiB of 1024 (``24GB`` is 22.35 GiB: a cap written in GB comes out tighter, never
looser). Units are case-insensitive; single letters (``24G``) are refused as ambiguous, a capital prefix with
a small ``b`` (``12Gb``) as bits."""

from __future__ import annotations

import math
import re

BYTE_UNITS: dict[str, int] = {"b": 1, "byte": 1, "bytes": 1}
for _power, _prefix in enumerate("kmgt", start=1):
    BYTE_UNITS |= {f"{_prefix}b": 1000**_power, f"{_prefix}ib": 1024**_power}

BYTES_HELP = "a byte count or a number with a unit: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB (e.g. 24GiB)"


class UnitError(ValueError):
    """A value that is not a size or a duration: ``reason`` the short why; str() adds the forms."""

    def __init__(self, reason: str, expected: str) -> None:
        super().__init__(f"{reason}; expected {expected}")
        self.reason, self.expected = reason, expected


_NUMBER = r"(?:\d+(?:\.\d*)?|\.\d+)"
_BYTES_RE = re.compile(rf"^\s*({_NUMBER})\s*([a-z]*)\s*$", re.IGNORECASE)


def parse_bytes(value: str | int | float, *, unit_required: bool = False) -> int:
    """``"24GiB"`` -> 25769803776; plain numbers are bytes, rounded down; raises UnitError. With
    ``unit_required`` a number but 0 needs a unit (``gpu_memory_limit: 24`` almost means 24 GiB)."""
    if isinstance(value, bool):
        raise UnitError("a boolean is not a size", BYTES_HELP)
    text = str(value).strip()
    if unit_required and re.fullmatch(_NUMBER, text) and float(text) != 0:
        raise UnitError(
            f"{text} has no unit (it would be read as {text} bytes)",
            f"a number with a unit, e.g. {text}GiB or {text}MiB (or {text}B for bytes)",
        )
    if isinstance(value, (int, float)):
        if not math.isfinite(value) or value < 0:
            raise UnitError("must be a finite number >= 0", BYTES_HELP)
        return int(value)
    if (match := _BYTES_RE.match(value)) is None:
        raise UnitError("not a number with a unit", BYTES_HELP)
    number, unit = match.groups()
    if unit and unit.endswith("b") and any(c.isupper() for c in unit[:-1]):
        # A capital prefix with a small b (Gb, Mb, Gib) is the usual spelling of bits.
        raise UnitError(f"{unit!r} means bits (a small b)", f"{number}{unit[:-1]}B for bytes")
    if (factor := BYTE_UNITS.get(unit.lower() if unit else "b")) is None:
        raise UnitError(f"unknown unit {unit!r}", BYTES_HELP)
    return int(float(number) * factor)


def format_bytes(n: int | float) -> str:
    """1610612736 -> ``"1.50 GiB"``; below 1 KiB: ``"512 B"``. Binary units, two decimals."""
    sign = "-" if n < 0 else ""
    if (size := float(abs(n))) < 1024:
        return f"{sign}{int(size)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        size /= 1024
        if size < 1024 or unit == "TiB":
            break
    return f"{sign}{size:.2f} {unit}"
