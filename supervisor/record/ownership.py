"""Whose folder ``output_dir`` is: the supervisor moves and deletes entries of its run directory, so a
folder that is not empty and holds no run of ours (a ``state.json`` or ``events.jsonl`` of ours, or a
``.lock`` beside the job copies only) is refused before anything is written, and ``/``, homes and
the system's folders outright."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from qlora_supervise.supervisor.jobfile.system_paths import system_folder
from qlora_supervise.supervisor.record.journal import read_state

_FIRST_FILES = re.compile(r"\.lock|job\.yaml|job\.v\d+\.(yaml|json)")


def foreign_output_dir(root: Path, contents: bool = True) -> tuple[str, str] | None:
    """Why ``root`` may not be a run directory and the fix, or None; ``contents`` False: only
    where it is (a system folder, a home), not what it holds."""
    found = system_folder(root)
    if found is not None or not contents:
        return found
    real = Path(os.path.realpath(root))
    if not real.is_dir() or is_run_dir(real):
        return None
    return (
        "exists, is not empty and holds no run of qlora-supervise (no state.json or events.jsonl of "
        "ours); the supervisor would move, replace or delete the files there",
        f"choose a new or empty folder for output_dir (for example a subfolder, such as {real}/run), "
        "or give the path of this run's own output_dir",
    )


def is_run_dir(root: Path) -> bool:
    """Whether ``root`` is empty or holds a run of ours (see the module's docstring)."""
    try:
        names = [entry.name for entry in os.scandir(root)]
    except OSError:
        return False
    if not names:
        return True
    state = root / "state.json"
    if state.is_file() and not state.is_symlink() and read_state(state) is not None:
        return True
    if _first_line_is_ours(root / "events.jsonl"):
        return True
    return ".lock" in names and all(_FIRST_FILES.fullmatch(name) for name in names)


def _first_line_is_ours(path: Path) -> bool:
    """An event log line of ours: a JSON object with ``event`` and ``level``."""
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with path.open("rb") as handle:
            line = handle.readline(64 * 1024)
        record = json.loads(line)
    except (OSError, ValueError):
        return False
    return isinstance(record, dict) and {"event", "level"} <= record.keys()
