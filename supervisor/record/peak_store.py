"""The per-host store of observed peaks, so the next run on the same server starts calibrated.

One JSON line per attempt that finished at least one optimizer step on a GPU:
``{"shape": {...ModelShape...}, "knobs": {...Knobs...}, "peak_bytes": int, "time": float}``.

Where: ``$QLORA_SUPERVISE_STATE_DIR/peaks.jsonl``, else ``$XDG_STATE_HOME/qlora-supervise/
peaks.jsonl``, else ``~/.local/state/qlora-supervise/peaks.jsonl`` (under the systemd unit,
``StateDirectory=`` provides ``$STATE_DIRECTORY``, which comes first). It is a cache: deleting it
loses nothing but the head start, a torn or foreign line is skipped, and it keeps the newest
:data:`KEEP_LINES` lines. ``supervise.calibration_store: false`` turns it off for a job.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from qlora_supervise.policies.memory_model import ModelShape, Observation
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


def read_observations(path: Path, shape: ModelShape) -> list[Observation]:
    """Every stored peak of this model shape (an unreadable store is an empty one)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError:
        return []
    wanted = dataclasses.asdict(shape)
    found = []
    for line in lines:
        try:
            raw = json.loads(line)
            if raw.get("shape") == wanted:
                found.append(Observation(Knobs(**raw["knobs"]), int(raw["peak_bytes"])))
        except (ValueError, TypeError, KeyError, AttributeError):
            continue
    return found


def record_peak(path: Path, shape: ModelShape, knobs: Knobs, peak_bytes: int) -> bool:
    """Append one observation; False (and nothing raised) when the store cannot be written.

    The store is an optimisation, so a read-only home or a full disk never stops a run.
    """
    line = json.dumps(
        {
            "shape": dataclasses.asdict(shape),
            "knobs": dataclasses.asdict(knobs),
            "peak_bytes": peak_bytes,
            "time": round(time.time(), 1),
        }
    )
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o750)
        lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
        lines = [*lines[-(KEEP_LINES - 1) :], line]
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        return False
    return True
