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

from qlora_supervise.trainer_child.contract.attempt_facts import RankReduction
from qlora_supervise.trainer_child.contract.checkpoint_dirs import (
    CHECKPOINT_COMPLETE_MARKER,
    CHECKPOINT_PREFIX,
    checkpoint_step,
    complete_checkpoints,
    file_digests,
    quarantine,
)
from qlora_supervise.trainer_child.contract.durable import fsync_dir, write_text_atomic
from qlora_supervise.trainer_child.contract.processes import pid_alive
from qlora_supervise.trainer_child.contract.spec import Knobs

TEMP_PREFIX = ".tmp-"
_TRAINER_STATE = "trainer_state.json"


class CheckpointLoadError(Exception):
    """The checkpoint to resume from cannot be loaded (a file is corrupt, truncated or missing):
    the child exits ExitCode.CHECKPOINT and names it, so the supervisor quarantines it."""


#: Checkpoint files that hold optimizer state; left out when the optimizer is reset.
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")


@dataclasses.dataclass(frozen=True)
class ResumeSource:
    """Where an attempt resumes: ``load_from`` is what Trainer reads; ``reset_from`` is set when
    the optimizer state starts afresh (the scheduler is then restored from it, at the step),
    with ``reset_reason`` in words; ``original`` is the checkpoint itself (named in reports)."""

    load_from: str | None = None
    reset_from: str | None = None
    reset_reason: str | None = None
    original: str | None = None
    rank_reduction: RankReduction | None = None  # the adapter was cut to a smaller rank (SVD)


def staging_dir(checkpoints_dir: Path, step: int, owner: int | None = None) -> Path:
    """Where step ``step`` is written before it is sealed; ``owner`` (default: this process) is
    the pid whose death makes it a leftover (:func:`remove_stale_temps`)."""
    return checkpoints_dir / f"{TEMP_PREFIX}{CHECKPOINT_PREFIX}{step}-{owner or os.getpid()}"


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
    """Seal ``written`` (fsync, marker) and rename it to ``final``; return ``final``.

    The marker records the size and sha256 of every file it covers, so the supervisor can tell
    a checkpoint damaged after the fact (truncated, overwritten) before resuming from it. An
    unmarked directory already under the final name (left by hand or another tool; ours are
    never unmarked) would make the rename fail: it is quarantined first.
    """
    fsync_tree(written)
    marker = {
        "step": step,
        "knobs": dataclasses.asdict(knobs),
        "emergency": emergency,
        "time": time.time(),
        "files": file_digests(written),
    }
    write_text_atomic(written / CHECKPOINT_COMPLETE_MARKER, json.dumps(marker, indent=2, sort_keys=True))
    if final.exists() and not is_complete(final):
        quarantine(final, f"unmarked directory in the way of the save of step {step}")
    os.rename(written, final)
    fsync_dir(final.parent)
    return final


def is_complete(path: Path) -> bool:
    return (path / CHECKPOINT_COMPLETE_MARKER).is_file()


def rotate(checkpoints_dir: Path, keep: int, protect: Path | None) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, never ``protect`` (the one this
    attempt resumed from: if the new ones turn out bad, the supervisor falls back to it).

    Unmarked ``checkpoint-N`` leftovers (never usable, and in the way of a later save of step N)
    are moved to the quarantine folder on the way.
    """
    for leftover in unmarked_checkpoints(checkpoints_dir):
        quarantine(leftover, "unmarked checkpoint directory (no completion marker) found at rotation")
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


def unmarked_checkpoints(checkpoints_dir: Path) -> list[Path]:
    """``checkpoint-N`` directories without the completion marker."""
    if not checkpoints_dir.is_dir():
        return []
    return sorted(
        path
        for path in checkpoints_dir.iterdir()
        if path.is_dir() and checkpoint_step(path) is not None and not is_complete(path)
    )


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


def check_loadable(checkpoint: Path) -> None:
    """Cheap checks of what Trainer will read, before the model is loaded: ``trainer_state.json``
    parses with a step, and each safetensors file is as long as its header says. Raises
    CheckpointLoadError. (The loads themselves are guarded too: see the trainer.)"""
    state_path = checkpoint / _TRAINER_STATE
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointLoadError(f"{state_path}: unreadable ({exc})") from exc
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise CheckpointLoadError(f"{state_path}: no integer global_step")
    for tensors in sorted(checkpoint.glob("*.safetensors")):
        _check_safetensors_length(tensors)


def _check_safetensors_length(path: Path) -> None:
    """A safetensors file is 8 bytes of header length, the JSON header, then the data whose
    largest end offset the header gives: a shorter file was cut off."""
    size = path.stat().st_size
    try:
        with path.open("rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = json.loads(handle.read(length)) if 0 < length <= size - 8 else None
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointLoadError(f"{path}: header unreadable ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointLoadError(f"{path}: {size} bytes, too short for its header")
    ends = [
        entry["data_offsets"][1]
        for name, entry in header.items()
        if name != "__metadata__" and isinstance(entry, dict) and isinstance(entry.get("data_offsets"), list)
    ]
    needed = 8 + length + max(ends, default=0)
    if size < needed:
        raise CheckpointLoadError(f"{path}: {size} bytes, its header needs {needed}: truncated")
