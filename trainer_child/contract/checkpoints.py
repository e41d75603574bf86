"""Checkpoint directories that are either complete or invisible, and the emergency parts of ranks.

A checkpoint is written under ``.tmp-checkpoint-<step>-<pid>/`` (never matched as complete), every
file fsynced, the marker written last, then renamed to ``checkpoint-<step>``: a kill at any moment
leaves the old set of checkpoints or the old set plus one complete new one.

Under torchrun (DDP), after one rank fails the others are dead or stuck in a broken collective, so
each rank that can writes its *part* of step N with no collective (every rank holds the same state
there, and its own RNG) into ``.tmp-emergency-<step>-<launcher pid>/rank-<R>/``, ending with
:data:`PART_DONE`. The supervisor seals the checkpoint only when all ``world_size`` parts name the
same step (:func:`agreed_parts`). FSDP writes no parts (a rank holds only a shard).
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
#: Mode of the directories of a checkpoint, the adapter and the merged model: the run directory's.
DIR_MODE = 0o750
PART_DONE = "part.json"
#: The Trainer's per-rank RNG file (``Trainer._save_rng_state``).
RNG_FILE = "rng_state_{rank}.pth"
_TRAINER_STATE = "trainer_state.json"


class CheckpointLoadError(Exception):
    """The checkpoint to resume from cannot be loaded: the child exits ExitCode.CHECKPOINT naming it,
    so the supervisor quarantines it."""


#: Checkpoint files that hold optimizer state; left out when the optimizer is reset.
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")


@dataclasses.dataclass(frozen=True)
class ResumeSource:
    """Where an attempt resumes: ``load_from`` is what Trainer reads; ``reset_from`` when the
    optimizer state starts afresh (the scheduler restored from it), ``reset_reason`` why;
    ``original`` is the checkpoint itself (named in reports)."""

    load_from: str | None = None
    reset_from: str | None = None
    reset_reason: str | None = None
    original: str | None = None
    rank_reduction: RankReduction | None = None  # the adapter was cut to a smaller rank (SVD)


def staging_dir(checkpoints_dir: Path, step: int, owner: int | None = None) -> Path:
    """Where step ``step`` is written before it is sealed; ``owner`` (default: this process) is the
    pid whose death makes it a leftover. Refuses a linked ``checkpoints_dir`` before any save."""
    refuse_linked_dir(checkpoints_dir)
    return checkpoints_dir / f"{TEMP_PREFIX}{CHECKPOINT_PREFIX}{step}-{owner or os.getpid()}"


def settle_modes(root: Path) -> None:
    """:data:`DIR_MODE` on every directory under ``root`` (and itself), :data:`durable.FILE_MODE` on
    every file, links left alone: safetensors writes 0600, a merge by hand has the shell's umask."""
    for path in [root, *root.rglob("*")]:
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode):
            os.chmod(path, DIR_MODE)
        elif stat.S_ISREG(info.st_mode):
            os.chmod(path, FILE_MODE)


def replace_dir(temp: Path, final: Path) -> None:
    """Put the finished directory ``temp`` at ``final`` (the adapter, the merged model), durably;
    a link at ``final`` is removed, never followed. A kill between the two renames leaves
    ``.old-<name>-<pid>``, which the supervisor's disk reclaim deletes once this pid is gone."""
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
    """Every file under ``root``, then every directory (itself included)."""
    inside = sorted(root.rglob("*"))
    for path in [*(p for p in inside if p.is_file()), root, *(p for p in inside if p.is_dir())]:
        fsync_dir(path)


def publish(written: Path, final: Path, *, step: int, knobs: Knobs, emergency: bool) -> Path:
    """Seal ``written`` (fsync, a marker with each file's size and sha256) and rename it to
    ``final``. An unmarked directory in the way is quarantined first, a link there removed."""
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
    attempt resumed from: the fallback); unmarked ``checkpoint-N`` leftovers are quarantined."""
    for leftover in unmarked_checkpoints(checkpoints_dir):
        quarantine(leftover, "unmarked checkpoint directory (no completion marker) found at rotation")
    found = complete_checkpoints(checkpoints_dir)
    removed = []
    for _, path in found[: max(len(found) - keep, 0)]:
        if protect is not None and path.resolve() == protect.resolve():
            continue
        # Out of the checkpoint namespace first: a kill mid-delete leaves no half checkpoint.
        doomed = path.with_name(f"{TEMP_PREFIX}deleting-{path.name}-{os.getpid()}")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed


def unmarked_checkpoints(checkpoints_dir: Path) -> list[Path]:
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
    """A copy of ``checkpoint`` without optimizer state, for ``reset_optimizer`` (Trainer then skips
    the scheduler too: the recipe puts it back)."""
    target = scratch / checkpoint.name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(checkpoint, target, ignore=shutil.ignore_patterns(*OPTIMIZER_FILES))
    return target


def check_loadable(checkpoint: Path) -> None:
    """Before the model loads: ``trainer_state.json`` has an integer step and each safetensors file
    is as long as its header says; raises CheckpointLoadError."""
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
    """8 bytes of header length, the JSON header, then the data up to its largest end offset."""
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


def part_dir(checkpoints_dir: Path, step: int, owner: int, rank: int) -> Path:
    """Where rank ``rank`` of the launcher ``owner`` writes its part of step ``step`` (a stale temp
    once the launcher is gone, removed as the staging directories are)."""
    return checkpoints_dir / f"{TEMP_PREFIX}emergency-{step}-{owner}" / f"rank-{rank}"


def part_step(part: Path) -> int | None:
    """The step a finished part names; None when it is unfinished or unreadable."""
    try:
        step = json.loads((part / PART_DONE).read_text(encoding="utf-8")).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def agreed_parts(parts: list[Path], world_size: int) -> int | None:
    """The step every rank's part names, when there is one finished part per rank; else None."""
    steps = {part_step(part) for part in parts}
    if len(parts) != world_size or len(steps) != 1 or None in steps:
        return None
    return steps.pop()
