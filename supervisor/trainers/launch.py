"""The shim in a foreign trainer's process: the environment that puts it on the PYTHONPATH (found
beside the contract's processes module; nothing of it is imported here) with the spec named, and whether
it attached (its ``started`` line in the attempt's events file), said in the journal when it did not."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.trainer_child.contract import processes
from qlora_supervise.trainer_child.contract.events import Started, parse_event
from qlora_supervise.trainer_child.contract.spec import AttemptSpec

#: The same name as trainer_child.shim.SHIM_SPEC_ENV (tests/test_trainer_shim.py checks they agree).
SHIM_SPEC_ENV = "QLORA_SUPERVISE_SHIM_SPEC"
SHIM_SITE = Path(processes.__file__).resolve().parent.parent / "shim" / "site"
SHIM_SILENT = (
    "the trainer's process wrote none of our events (no `started` line in {events}): the shim did "
    "not attach (is qlora-supervise importable by {python}? does the tool build a transformers "
    "Trainer?), so this attempt is classified from its stderr tail alone"
)


def trainer_env(env: Mapping[str, str], spec: AttemptSpec, spec_path: Path) -> dict[str, str]:
    """``env`` plus the shim for a foreign attempt (``spec.command`` set); unchanged for ours."""
    out = dict(env)
    if not spec.command:
        return out
    path = out.get("PYTHONPATH", "")
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIM_SITE), path) if p)
    out[SHIM_SPEC_ENV] = str(spec_path)
    # It runs in the user's folder: no __pycache__ written beside the modules it imports from there.
    out["PYTHONDONTWRITEBYTECODE"] = "1"
    return out


def shim_attached(events_file: Path) -> bool:
    try:
        lines = events_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return False
    return any(isinstance(parse_event(line), Started) for line in lines)


def note_shim(spec: AttemptSpec, log: FilteringBoundLogger) -> bool:
    """Log ``shim_not_attached`` when a tool's attempt (``spec.command``) left no ``started``;
    True when the shim attached, or the attempt was our own child's."""
    events_file = Path(spec.events_file)
    if not spec.command or shim_attached(events_file):
        return True
    log.warning(Event.SHIM_NOT_ATTACHED, why=SHIM_SILENT.format(events=events_file, python=spec.command[0]))
    return False


def output_moving(spec: AttemptSpec, log_path: Path, wall_now: float, timeout_s: float) -> bool:
    """Whether a tool without the shim wrote to its log within ``timeout_s``: with no heartbeats, its
    own output is the only sign of progress left. False for our child and a tool the shim speaks for."""
    if not spec.command or shim_attached(Path(spec.events_file)):
        return False
    try:
        return wall_now - log_path.stat().st_mtime <= timeout_s
    except OSError:
        return False
