"""Byte sizes and durations as written in job files."""

from __future__ import annotations

import pytest

from qlora_supervise.supervisor.facts.units import (
    UnitError,
    format_bytes,
    format_duration,
    parse_bytes,
    parse_duration,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("24GiB", 24 * 1024**3),
        ("24GB", 24 * 10**9),
        ("500MB", 500 * 10**6),
        ("500MiB", 500 * 1024**2),
        ("64KiB", 64 * 1024),
        ("1.5GiB", int(1.5 * 1024**3)),
        ("24 gib", 24 * 1024**3),
        ("1TiB", 1024**4),
        ("123", 123),
        ("123B", 123),
        ("123 bytes", 123),
        (4096, 4096),
        (0, 0),
        (2.0e9, 2 * 10**9),
    ],
)
def test_parse_bytes_accepts(text: str | int | float, expected: int) -> None:
    """Decimal and binary units, any case, spaces, plain numbers and bytes all parse."""
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["20x", "24G", "GiB", "", "-1GiB", "1e9GB", "ten", True, -5, float("inf")])
def test_parse_bytes_refuses(text: str | int | float) -> None:
    """Unknown or ambiguous units, negatives, booleans and non-numbers raise UnitError."""
    with pytest.raises(UnitError) as caught:
        parse_bytes(text)
    assert "GiB" in str(caught.value)  # the message lists the allowed forms


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("20m", 1200.0),
        ("90s", 90.0),
        ("2h", 7200.0),
        ("1d", 86400.0),
        ("1h30m", 5400.0),
        ("1.5m", 90.0),
        ("30", 30.0),
        (45, 45.0),
        (2.5, 2.5),
        ("0", 0.0),
    ],
)
def test_parse_duration_accepts(text: str | int | float, expected: float) -> None:
    """Seconds, minutes, hours and days, combined or plain, come back as seconds."""
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["20x", "m", "", "-5", "5 minutes", True, -1, float("nan")])
def test_parse_duration_refuses(text: str | int | float) -> None:
    """Unknown units, negatives, booleans and words raise UnitError naming the allowed units."""
    with pytest.raises(UnitError) as caught:
        parse_duration(text)
    assert "20m" in str(caught.value)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1536, "1.50 KiB"),
        (int(1.5 * 1024**3), "1.50 GiB"),
        (80 * 1024**3, "80.00 GiB"),
        (3 * 1024**5, "3072.00 TiB"),
        (-2 * 1024**2, "-2.00 MiB"),
    ],
)
def test_format_bytes(n: int, expected: str) -> None:
    """Sizes print in binary units with two decimals."""
    assert format_bytes(n) == expected


@pytest.mark.parametrize(
    ("seconds", "expected"),
    [(2.5, "2.5s"), (60.0, "1m"), (1200.0, "20m"), (5400.0, "1h30m"), (90061.0, "1d1h1m1s")],
)
def test_format_duration(seconds: float, expected: str) -> None:
    """Durations print in the same units the job file accepts, and parse back to the same value."""
    assert format_duration(seconds) == expected
    assert parse_duration(expected) == seconds
