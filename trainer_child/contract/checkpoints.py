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
import stat
import time
from pathlib import Path

from qlora_supervise.trainer_child.contract.attempt_facts import RankReduction
from qlora_supervise.trainer_child.contract.checkpoint_dirs import (
    CHECKPOINT_COMPLETE_MARKER,
    CHECKPOINT_PREFIX,
    checkpoint_step,
    complete_checkpoints,
    file_digests,
    own_directory,
    quarantine,
    refuse_linked_dir,
)
from qlora_supervise.trainer_child.contract.durable import FILE_MODE, fsync_dir, write_text_atomic
from qlora_supervise.trainer_child.contract.processes import pid_alive
from qlora_supervise.trainer_child.contract.spec import Knobs

TEMP_PREFIX = ".tmp-"
#: Mode of the directories of a checkpoint, the adapter and the merged model: the run
#: directory's (``supervisor/record/runfiles.py``), group-readable, nothing for others.
DIR_MODE = 0o750
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
    the pid whose death makes it a leftover (:func:`remove_stale_temps`).

    Asked for before every save, so it is where a ``checkpoints_dir`` that became a symbolic link
    is refused (:class:`checkpoint_dirs.UnsafeCheckpointPath`) before anything is written.
    """
    refuse_linked_dir(checkpoints_dir)
    return checkpoints_dir / f"{TEMP_PREFIX}{CHECKPOINT_PREFIX}{step}-{owner or os.getpid()}"


def settle_modes(root: Path) -> None:
    """Give every directory under ``root`` (and itself) :data:`DIR_MODE` and every file
    :data:`durable.FILE_MODE`: the run's mode rules, whatever wrote them.

    Needed because the umask can only take bits away: safetensors writes its files 0600 (not
    group-readable), and a merge started by hand runs under the shell's umask (0755 / 0644).
    Links are left alone (``os.chmod`` would follow them).
    """
    for path in [root, *root.rglob("*")]:
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode):
            os.chmod(path, DIR_MODE)
        elif stat.S_ISREG(info.st_mode):
            os.chmod(path, FILE_MODE)


def replace_dir(temp: Path, final: Path) -> None:
    """Put the finished directory ``temp`` at ``final`` (the adapter, the merged model): modes
    settled, fsynced, the old one moved aside and deleted, renamed, the rename made durable.

    A symbolic link at ``final`` is removed, never followed (its target stays as it was); a kill
    between the two renames leaves ``.old-<name>-<pid>``, which the supervisor's disk reclaim
    deletes once this pid is gone.
    """
    settle_modes(temp)
    fsync_tree(temp)
    if final.is_symlink():
        os.unlink(final)
    elif final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(temp, final)
    fsync_dir(final.parent)


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
    never unmarked) would make the rename fail: it is quarantined first. A link under that name
    is removed (the link only; what it points to is never touched).
    """
    settle_modes(written)
    fsync_tree(written)
    marker = {
        "step": step,
        "knobs": dataclasses.asdict(knobs),
        "emergency": emergency,
        "time": time.time(),
        "files": file_digests(written),
    }
    write_text_atomic(written / CHECKPOINT_COMPLETE_MARKER, json.dumps(marker, indent=2, sort_keys=True))
    if final.is_symlink():
        os.unlink(final)
    elif final.exists() and not is_complete(final):
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
        if own_directory(path) and checkpoint_step(path) is not None and not is_complete(path)
    )


def remove_stale_temps(checkpoints_dir: Path) -> list[Path]:
    """Delete temp directories left by killed children (those whose pid is gone)."""
    removed: list[Path] = []
    if not own_directory(checkpoints_dir):
        return removed
    for path in checkpoints_dir.iterdir():
        tail = path.name.rsplit("-", 1)[-1]
        if path.name.startswith(TEMP_PREFIX) and tail.isdigit() and not pid_alive(int(tail)):
            if path.is_symlink():
                path.unlink()  # the link only: rmtree would refuse it, and must not follow it
            else:
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
