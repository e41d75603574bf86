"""The per-host store of observed peaks and speeds (one JSON line per attempt that trained a step on a
GPU), so the next run on the same server starts calibrated. A cache: a torn or foreign line is skipped,
the newest :data:`KEEP_LINES` are kept; each line names the ``trainer`` whose process measured it,
which alone it calibrates. Writers on one host take an ``fcntl.flock`` on a lock file beside it."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from qlora_supervise.policies.memory_model import ModelShape, Observation
from qlora_supervise.policies.search.throughput import SpeedObservation
from qlora_supervise.supervisor.facts.trainer import OWN
from qlora_supervise.trainer_child.contract.spec import Knobs

KEEP_LINES = 2000


def default_path() -> Path:
    """``$QLORA_SUPERVISE_STATE_DIR``, ``$STATE_DIRECTORY`` (systemd's ``StateDirectory=``), then
    ``$XDG_STATE_HOME/qlora-supervise``, else ``~/.local/state/qlora-supervise``: ``peaks.jsonl``."""
    for variable in ("QLORA_SUPERVISE_STATE_DIR", "STATE_DIRECTORY"):
        if value := os.environ.get(variable):
            return Path(value.split(":")[0]) / "peaks.jsonl"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "qlora-supervise" / "peaks.jsonl"


@dataclasses.dataclass(frozen=True)
class _Stored:
    shape: dict[str, Any]
    knobs: Knobs
    trainer: str
    peak_bytes: int | None = None
    tokens_per_s: float | None = None


_STORED = TypeAdapter(_Stored)


def _lines_of(path: Path, shape: ModelShape, trainer: str) -> Iterator[_Stored]:
    """The store's lines of this shape and trainer (an unreadable store is an empty one)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return
    wanted = shape.sizes()  # the sizes alone: lines written before the architecture facts still match
    for line in lines:
        try:
            stored = _STORED.validate_json(line)
        except ValueError:
            continue
        if stored.shape == wanted and stored.trainer == trainer:
            yield stored


def read_observations(path: Path, shape: ModelShape, trainer: str = OWN) -> list[Observation]:
    """Every stored peak of this model shape, measured in ``trainer``'s process."""
    lines = _lines_of(path, shape, trainer)
    return [Observation(line.knobs, line.peak_bytes) for line in lines if line.peak_bytes is not None]


def read_speeds(path: Path, shape: ModelShape, trainer: str = OWN) -> list[SpeedObservation]:
    """Every stored tokens/s of this model shape measured in ``trainer``'s process, oldest first."""
    rates = [(line.knobs, line.tokens_per_s) for line in _lines_of(path, shape, trainer)]
    return [SpeedObservation(knobs, rate) for knobs, rate in rates if rate is not None and rate > 0]


def record_attempt(
    path: Path,
    shape: ModelShape,
    knobs: Knobs,
    peak_bytes: int | None,
    tokens_per_s: float | None,
    trainer: str = OWN,
) -> bool:
    """Append one attempt's peak and speed; False (and nothing raised) when the store cannot be
    written: a read-only home or a full disk never stops a run."""
    if peak_bytes is None and tokens_per_s is None:
        return True
    rate = None if tokens_per_s is None else round(tokens_per_s, 1)
    fields = {"shape": shape.sizes(), "knobs": dataclasses.asdict(knobs), "peak_bytes": peak_bytes}
    line = json.dumps({**fields, "tokens_per_s": rate, "trainer": trainer, "time": round(time.time(), 1)})
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        lock = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o640)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
            lines = [*lines[-(KEEP_LINES - 1) :], line]
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
            os.replace(tmp, path)
        finally:
            os.close(lock)  # closing drops the lock
    except OSError:
        return False
    return True
