"""Whether the shim attached in a foreign trainer's process (its ``started`` line in the attempt's
events file), said in the journal when it did not: no heartbeats, no stage, no error report."""

from __future__ import annotations

from pathlib import Path

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.trainer_child.contract.events import Started, parse_event
from qlora_supervise.trainer_child.contract.spec import AttemptSpec

SHIM_SILENT = (
    "the trainer's process wrote none of our events (no `started` line in {events}): the shim did "
    "not attach (is qlora-supervise importable by {python}? does the tool build a transformers "
    "Trainer?), so this attempt is classified from its stderr tail alone"
)


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
    python = spec.command[0]
    log.warning(Event.SHIM_NOT_ATTACHED, why=SHIM_SILENT.format(events=events_file, python=python))
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
