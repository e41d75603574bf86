"""Checkpoint directories that are either complete or invisible.

A checkpoint is written under ``.tmp-checkpoint-<step>-<pid>/`` (a name that
:func:`checkpoint_dirs.complete_checkpoints` never matches), every file is fsynced, the marker is
written last, and only then is it renamed to ``checkpoint-<step>``. A kill at any moment
leaves the old set of checkpoints or the old set plus one complete new one.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path

from .checkpoint_dirs import CHECKPOINT_COMPLETE_MARKER, CHECKPOINT_PREFIX, complete_checkpoints
from .durable import fsync_dir, write_text_atomic
from .processes import pid_alive
from .protocol import Knobs

TEMP_PREFIX = ".tmp-"
#: Checkpoint files that hold optimizer state; left out when the optimizer is reset.
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")


def staging_dir(checkpoints_dir: Path, step: int) -> Path:
    return checkpoints_dir / f"{TEMP_PREFIX}{CHECKPOINT_PREFIX}{step}-{os.getpid()}"


def fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    for directory in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        fsync_dir(directory)


def publish(written: Path, final: Path, *, step: int, knobs: Knobs, emergency: bool) -> Path:
    """Seal ``written`` (fsync, marker) and rename it to ``final``; return ``final``."""
    marker = {"step": step, "knobs": dataclasses.asdict(knobs), "emergency": emergency, "time": time.time()}
    fsync_tree(written)
    write_text_atomic(written / CHECKPOINT_COMPLETE_MARKER, json.dumps(marker, indent=2, sort_keys=True))
    os.rename(written, final)
    fsync_dir(final.parent)
    return final


def is_complete(path: Path) -> bool:
    return (path / CHECKPOINT_COMPLETE_MARKER).is_file()


def rotate(checkpoints_dir: Path, keep: int, protect: Path | None) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, never ``protect`` (the one this
    attempt resumed from: if the new ones turn out bad, the supervisor falls back to it)."""
    found = complete_checkpoints(checkpoints_dir)
    removed = []
    for _, path in found[: max(len(found) - keep, 0)]:
        if protect is not None and path.resolve() == protect.resolve():
            continue
        # Rename out of the checkpoint namespace first, so a kill mid-delete leaves no half
        # directory under a checkpoint name (the marker may already be gone).
        doomed = path.with_name(f"{TEMP_PREFIX}deleting-{path.name}-{os.getpid()}")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed


def remove_stale_temps(checkpoints_dir: Path) -> list[Path]:
    """Delete temp directories left by killed children (those whose pid is gone)."""
    removed: list[Path] = []
    if not checkpoints_dir.is_dir():
        return removed
    for path in checkpoints_dir.iterdir():
        tail = path.name.rsplit("-", 1)[-1]
        if path.name.startswith(TEMP_PREFIX) and tail.isdigit() and not pid_alive(int(tail)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def without_optimizer(checkpoint: Path, scratch: Path) -> Path:
    """A copy of ``checkpoint`` without optimizer state, for ``reset_optimizer``.

    The adapter, trainer state (step, data position), RNG and scheduler files stay; Trainer
    only restores optimizer *and* scheduler when the optimizer file exists, so the scheduler
    is put back separately by the recipe.
    """
    target = scratch / checkpoint.name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(checkpoint, target, ignore=shutil.ignore_patterns(*OPTIMIZER_FILES))
    return target
