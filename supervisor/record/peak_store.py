"""The per-host store of observed peaks and speeds, so the next run on the same server starts calibrated.

One JSON line per attempt that finished at least one optimizer step on a GPU:
``{"shape": {...ModelShape...}, "knobs": {...Knobs...}, "peak_bytes": int | null,
"tokens_per_s": float | null, "trainer": str, "time": float}``. ``trainer`` is whose process
measured it (``own``, or a foreign kind such as ``axolotl``): the same knobs peak lower or higher
in another tool (its loss, its upcasts, its kernels), so each calibrates only its own. A line
without it is skipped: the supervisor before it stored foreign tools' attempts unlabelled too, and
a tool's lower peaks calibrating our trainer would plan it too close to the card.
``peak_bytes`` calibrates the memory model, ``tokens_per_s`` (the attempt's median over its
heartbeats, for the knobs it trained with) the throughput model; a line may carry either or both.

Where: ``$QLORA_SUPERVISE_STATE_DIR/peaks.jsonl``, else ``$XDG_STATE_HOME/qlora-supervise/
peaks.jsonl``, else ``~/.local/state/qlora-supervise/peaks.jsonl`` (under the systemd unit,
``StateDirectory=`` provides ``$STATE_DIRECTORY``, which comes first). It is a cache: deleting it
loses nothing but the head start, a torn or foreign line is skipped, and it keeps the newest
:data:`KEEP_LINES` lines. ``supervise.calibration_store: false`` turns it off for a job.

Several supervisors on one host write it: each write holds an exclusive ``fcntl.flock`` on a lock
file beside the store for its read-modify-write (the store itself is replaced by a rename, so a
lock on it would be a lock on an inode the next writer no longer opens).
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from qlora_supervise.policies.memory_model import ModelShape, Observation
from qlora_supervise.policies.search.throughput import SpeedObservation
from qlora_supervise.supervisor.facts.trainer import OWN
from qlora_supervise.trainer_child.contract.spec import Knobs

KEEP_LINES = 2000


def default_path() -> Path:
    """The store's file on this host, by the order in the module docstring."""
    for variable in ("QLORA_SUPERVISE_STATE_DIR", "STATE_DIRECTORY"):
        value = os.environ.get(variable)
        if value:
            return Path(value.split(":")[0]) / "peaks.jsonl"
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "qlora-supervise" / "peaks.jsonl"


@dataclasses.dataclass(frozen=True)
class _Stored:
    """One line of the store."""

    shape: dict[str, Any]
    knobs: Knobs
    trainer: str
    peak_bytes: int | None = None
    tokens_per_s: float | None = None


_STORED = TypeAdapter(_Stored)


def _lines_of(path: Path, shape: ModelShape, trainer: str) -> Iterator[_Stored]:
    """The store's lines of this shape and trainer (an unreadable store is an empty one; a torn
    or foreign line is skipped)."""
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
    lines = _lines_of(path, shape, trainer)
    rates = [(line.knobs, line.tokens_per_s) for line in lines]
    return [SpeedObservation(knobs, rate) for knobs, rate in rates if rate is not None and rate > 0]


def record_peak(path: Path, shape: ModelShape, knobs: Knobs, peak_bytes: int) -> bool:
    """Append one peak; False (and nothing raised) when the store cannot be written."""
    return record_attempt(path, shape, knobs, peak_bytes, None)


def record_attempt(
    path: Path,
    shape: ModelShape,
    knobs: Knobs,
    peak_bytes: int | None,
    tokens_per_s: float | None,
    trainer: str = OWN,
) -> bool:
    """Append one attempt's peak and speed; False (and nothing raised) when the store cannot be
    written. The store is an optimisation, so a read-only home or a full disk never stops a run."""
    if peak_bytes is None and tokens_per_s is None:
        return True
    line = json.dumps(
        {
            "shape": shape.sizes(),
            "knobs": dataclasses.asdict(knobs),
            "peak_bytes": peak_bytes,
            "tokens_per_s": None if tokens_per_s is None else round(tokens_per_s, 1),
            "trainer": trainer,
            "time": round(time.time(), 1),
        }
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        with _locked(path):
            lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
            lines = [*lines[-(KEEP_LINES - 1) :], line]
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
            os.replace(tmp, path)
    except OSError:
        return False
    return True


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock for one read-modify-write of the store (blocks while another holds it)."""
    fd = os.open(path.with_name(f".{path.name}.lock"), os.O_RDWR | os.O_CREAT, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing drops the lock
