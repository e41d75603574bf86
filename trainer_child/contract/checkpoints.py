"""Checkpoint directories that are complete or invisible, named and read alike by the child and the
supervisor: written under ``.tmp-checkpoint-<step>-<pid>/``, fsynced, marked last, then renamed.
Under torchrun (DDP) each rank that can writes its *part* of an emergency checkpoint with no
collective; the supervisor seals it only when all parts name one step (:func:`agreed_parts`)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import stat
import time
from pathlib import Path
from typing import Any

from qlora_supervise.trainer_child.contract.attempt_facts import RankReduction
from qlora_supervise.trainer_child.contract.durable import FILE_MODE, fsync_dir, write_text_atomic
from qlora_supervise.trainer_child.contract.processes import pid_alive
from qlora_supervise.trainer_child.contract.spec import Knobs

#: Written last into a complete checkpoint: lets a reader reject a copied or truncated directory.
CHECKPOINT_COMPLETE_MARKER = "qlora_supervise_complete.json"
CHECKPOINT_PREFIX = "checkpoint-"
#: Beside ``checkpoints/``: checkpoints that must not be resumed; nothing there is deleted by us.
QUARANTINE_DIR = "checkpoints-quarantine"
QUARANTINE_REASON = "quarantine_reason.txt"
TEMP_PREFIX = ".tmp-"
#: Mode of the directories of a checkpoint, the adapter and the merged model: the run directory's.
DIR_MODE = 0o750
PART_DONE = "part.json"
#: The Trainer's per-rank RNG file (``Trainer._save_rng_state``).
RNG_FILE = "rng_state_{rank}.pth"


class UnsafeCheckpointPath(Exception):
    """A checkpoint path that is a symbolic link (or no directory): never written through."""


def own_directory(path: Path) -> bool:
    """``path`` is a real directory (not a link to one): the only kind we write into or delete."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def refuse_linked_dir(path: Path) -> None:
    """Raise :class:`UnsafeCheckpointPath` when ``path`` exists and is a link or no directory."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISLNK(mode):
        raise UnsafeCheckpointPath(
            f"{path} is a symbolic link; refusing to write checkpoints through it: remove it "
            "(nothing but the supervisor should create entries in a run directory)"
        )
    if not stat.S_ISDIR(mode):
        raise UnsafeCheckpointPath(f"{path} is not a directory: remove it")


def checkpoint_step(path: Path) -> int | None:
    """The optimizer step of a ``checkpoint-<step>`` directory name, else None."""
    tail = path.name.removeprefix(CHECKPOINT_PREFIX)
    return int(tail) if path.name.startswith(CHECKPOINT_PREFIX) and tail.isdigit() else None


def complete_checkpoints(checkpoints_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints (the final name *and* the marker, no link), oldest first."""
    root = Path(checkpoints_dir)
    if not own_directory(root):
        return []
    named = ((checkpoint_step(child), child) for child in root.iterdir())
    return sorted((step, c) for step, c in named if step is not None and own_directory(c) and is_complete(c))


def newest_complete_checkpoint(checkpoints_dir: str | os.PathLike[str]) -> tuple[int, Path] | None:
    """The (step, path) of the newest complete checkpoint, or None when there is none."""
    return next(reversed(complete_checkpoints(checkpoints_dir)), None)


def file_digests(root: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size": bytes, "sha256": hex}}`` of every file under ``root`` but the marker."""
    files = {path.relative_to(root).as_posix(): path for path in sorted(root.rglob("*")) if path.is_file()}
    files.pop(CHECKPOINT_COMPLETE_MARKER, None)
    return {name: {"size": path.stat().st_size, "sha256": _sha256(path)} for name, path in files.items()}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_marker(path: Path) -> dict[str, Any] | None:
    """The completion marker of checkpoint ``path`` as a JSON object; None when unreadable."""
    try:
        marker = json.loads((path / CHECKPOINT_COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def damaged_files(path: Path) -> dict[str, str] | None:
    """``{file: why}`` per file unlike the marker (empty: intact or unlisted); None: marker unreadable."""
    if (marker := read_marker(path)) is None:
        return None
    if (files := marker.get("files")) is None:
        return {}
    if not isinstance(files, dict):
        return None
    found = {name: _file_damage(path / name, expected) for name, expected in files.items()}
    return {name: why for name, why in found.items() if why is not None}


def _file_damage(path: Path, expected: object) -> str | None:
    if not isinstance(expected, dict):
        return "malformed marker entry"
    try:
        size = path.stat().st_size
    except OSError:
        return "missing"
    if size != expected.get("size"):
        return f"{size} bytes, the marker says {expected.get('size')}"
    return "contents differ from the marker's sha256" if _sha256(path) != expected.get("sha256") else None


def quarantine(path: Path, reason: str) -> Path:
    """Move checkpoint ``path`` into the quarantine folder, with the reason; return where it went."""
    if not own_directory(path):
        raise UnsafeCheckpointPath(f"{path} is a symbolic link or no directory; refusing to quarantine it")
    folder = path.parent.parent / QUARANTINE_DIR
    refuse_linked_dir(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / path.name
    if target.exists():
        target = folder / f"{path.name}.{time.time_ns()}"
    os.rename(path, target)
    (target / QUARANTINE_REASON).write_text(reason + "\n", encoding="utf-8")
    return target


class CheckpointLoadError(Exception):
    """The checkpoint to resume from cannot be loaded (ExitCode.CHECKPOINT: it is quarantined)."""


#: Checkpoint files that hold optimizer state; left out when the optimizer is reset.
OPTIMIZER_FILES = ("optimizer.pt", "optimizer.bin")


@dataclasses.dataclass(frozen=True)
class ResumeSource:
    """Where an attempt resumes: ``load_from`` is what Trainer reads, ``original`` the checkpoint;
    ``reset_from`` when the optimizer starts afresh (the scheduler restored from it)."""

    load_from: str | None = None
    reset_from: str | None = None
    reset_reason: str | None = None
    original: str | None = None
    rank_reduction: RankReduction | None = None  # the adapter was cut to a smaller rank (SVD)


def staging_dir(checkpoints_dir: Path, step: int, owner: int | None = None) -> Path:
    """Where step ``step`` is written before it is sealed, a leftover once ``owner`` (default: this
    process) is gone; refuses a linked ``checkpoints_dir``."""
    refuse_linked_dir(checkpoints_dir)
    return checkpoints_dir / f"{TEMP_PREFIX}{CHECKPOINT_PREFIX}{step}-{owner or os.getpid()}"


def seal(root: Path) -> None:
    """The run's modes on ``root`` and all in it but links (safetensors writes 0600); then all fsynced."""
    inside = sorted(root.rglob("*"))
    for path in [root, *inside]:
        mode = os.lstat(path).st_mode
        if stat.S_ISDIR(mode):
            os.chmod(path, DIR_MODE)
        elif stat.S_ISREG(mode):
            os.chmod(path, FILE_MODE)
    for path in [*(p for p in inside if p.is_file()), root, *(p for p in inside if p.is_dir())]:
        fsync_dir(path)


def replace_dir(temp: Path, final: Path) -> None:
    """Put the finished directory ``temp`` at ``final`` durably (a link there removed); a kill between
    the renames leaves ``.old-<name>-<pid>`` for the supervisor's disk reclaim."""
    seal(temp)
    if final.is_symlink():
        os.unlink(final)
    elif final.exists():
        old = final.with_name(f".old-{final.name}-{os.getpid()}")
        os.rename(final, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(temp, final)
    fsync_dir(final.parent)


def publish(written: Path, final: Path, *, step: int, knobs: Knobs, emergency: bool) -> Path:
    """Seal ``written`` and rename it to ``final`` (an unmarked directory there quarantined first)."""
    seal(written)
    marker = {"step": step, "knobs": dataclasses.asdict(knobs), "emergency": emergency, "time": time.time()}
    marker["files"] = file_digests(written)
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
    """Delete all but the newest ``keep`` complete checkpoints, never ``protect`` (the fallback);
    unmarked leftovers are quarantined."""
    for path in sorted(checkpoints_dir.iterdir()) if checkpoints_dir.is_dir() else []:
        if own_directory(path) and checkpoint_step(path) is not None and not is_complete(path):
            quarantine(path, "unmarked checkpoint directory (no completion marker) found at rotation")
    protect_path = None if protect is None else protect.resolve()
    found = [path for _, path in complete_checkpoints(checkpoints_dir)]
    removed = [path for path in found[: max(len(found) - keep, 0)] if path.resolve() != protect_path]
    for path in removed:
        # Out of the checkpoint namespace first: a kill mid-delete leaves no half checkpoint.
        doomed = path.with_name(f"{TEMP_PREFIX}deleting-{path.name}-{os.getpid()}")
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return removed


def remove_stale_temps(checkpoints_dir: Path) -> list[Path]:
    """Delete temp directories left by killed children (those whose pid is gone)."""
    removed: list[Path] = []
    for path in checkpoints_dir.iterdir() if own_directory(checkpoints_dir) else []:
        tail = path.name.rsplit("-", 1)[-1]
        if path.name.startswith(TEMP_PREFIX) and tail.isdigit() and not pid_alive(int(tail)):
            if path.is_symlink():
                path.unlink()  # the link only: rmtree would refuse it, and must not follow it
            else:
                shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def without_optimizer(checkpoint: Path, scratch: Path) -> Path:
    """A copy of ``checkpoint`` without optimizer state (the recipe puts the scheduler back)."""
    target = scratch / checkpoint.name
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(checkpoint, target, ignore=shutil.ignore_patterns(*OPTIMIZER_FILES))
    return target


def check_loadable(checkpoint: Path) -> None:
    """Raise CheckpointLoadError unless the trainer state has a step and no safetensors is cut off."""
    state_path = checkpoint / "trainer_state.json"
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointLoadError(f"{state_path}: unreadable ({exc})") from exc
    if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
        raise CheckpointLoadError(f"{state_path}: no integer global_step")
    # A safetensors file: 8 bytes of header length, the JSON header, the data up to its largest end offset.
    for path in sorted(checkpoint.glob("*.safetensors")):
        size = path.stat().st_size
        try:
            with path.open("rb") as handle:
                length = int.from_bytes(handle.read(8), "little")
                header = json.loads(handle.read(length)) if 0 < length <= size - 8 else None
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise CheckpointLoadError(f"{path}: header unreadable ({exc})") from exc
        if not isinstance(header, dict):
            raise CheckpointLoadError(f"{path}: {size} bytes, too short for its header")
        entries = [item for name, item in header.items() if name != "__metadata__" and isinstance(item, dict)]
        ends = [entry["data_offsets"][1] for entry in entries if isinstance(entry.get("data_offsets"), list)]
        needed = 8 + length + max(ends, default=0)
        if size < needed:
            raise CheckpointLoadError(f"{path}: {size} bytes, its header needs {needed}: truncated")


def part_dir(checkpoints_dir: Path, step: int, owner: int, rank: int) -> Path:
    """Where rank ``rank`` of the launcher ``owner`` writes its part of step ``step``."""
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
    return steps.pop() if len(parts) == world_size and len(steps) == 1 else None
