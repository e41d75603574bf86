"""Checkpoint directory names and which of them count as complete.

Standard library only: the child writes checkpoints (:mod:`.checkpoints`) and the supervisor
picks the one to resume from, and both must agree on these names.
"""

from __future__ import annotations

import os
from pathlib import Path

#: A complete checkpoint directory holds this file, written last (after the rename it is
#: redundant, but it lets a reader reject a directory copied by hand or truncated by a full disk).
CHECKPOINT_COMPLETE_MARKER = "qlora_supervise_complete.json"
CHECKPOINT_PREFIX = "checkpoint-"


def checkpoint_step(path: Path) -> int | None:
    """The optimizer step of a ``checkpoint-<step>`` directory name, else None."""
    name = path.name
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    tail = name[len(CHECKPOINT_PREFIX) :]
    return int(tail) if tail.isdigit() else None


def complete_checkpoints(checkpoints_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first. Temp names and unmarked directories are ignored.

    A checkpoint counts only when its directory carries the final name *and* the marker
    written after every other file: a kill during the write leaves a temp name, which is skipped.
    """
    root = Path(checkpoints_dir)
    if not root.is_dir():
        return []
    found: list[tuple[int, Path]] = []
    for child in root.iterdir():
        step = checkpoint_step(child)
        if step is not None and (child / CHECKPOINT_COMPLETE_MARKER).is_file():
            found.append((step, child))
    return sorted(found)


def newest_complete_checkpoint(checkpoints_dir: str | os.PathLike[str]) -> tuple[int, Path] | None:
    """The (step, path) of the newest complete checkpoint, or None when there is none."""
    found = complete_checkpoints(checkpoints_dir)
    return found[-1] if found else None
