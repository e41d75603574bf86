"""Whether the shim attached in a foreign trainer's process, said in the journal when it did not.

The shim's first line in the attempt's events file is our ``started`` record. Without it (the
tool never imported ``transformers.trainer``, its venv lacks qlora-supervise, its Python is not
the one the shim was written for), there are no heartbeats, no stage and no error report: the
classifier reads the stderr tail alone, and ``events.jsonl`` says so.
"""

from __future__ import annotations

from pathlib import Path

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.trainer_child.contract.events import Started, parse_event

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


def note_shim(events_file: Path, command: tuple[str, ...], log: FilteringBoundLogger) -> bool:
    """Log ``shim_not_attached`` when the shim left no ``started``; True when it attached."""
    if shim_attached(events_file):
        return True
    python = command[0] if command else "the tool's Python"
    log.warning(Event.SHIM_NOT_ATTACHED, why=SHIM_SILENT.format(events=events_file, python=python))
    return False


def output_moving(log_path: Path, wall_now: float, timeout_s: float) -> bool:
    """Whether a foreign tool without the shim wrote to its log within ``timeout_s``: with no
    heartbeats, its own output (progress bars, log lines) is the only sign of progress left, so a
    long run is not taken for a hang; a log silent for the timeout still is one."""
    try:
        return wall_now - log_path.stat().st_mtime <= timeout_s
    except OSError:
        return False
