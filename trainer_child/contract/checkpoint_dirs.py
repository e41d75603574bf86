"""Checkpoint directory names and which of them count as complete.

Standard library only: the child writes checkpoints (:mod:`.checkpoints`) and the supervisor
picks the one to resume from, and both must agree on these names.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

#: A complete checkpoint directory holds this file, written last (after the rename it is
#: redundant, but it lets a reader reject a directory copied by hand or truncated by a full disk).
CHECKPOINT_COMPLETE_MARKER = "qlora_supervise_complete.json"
CHECKPOINT_PREFIX = "checkpoint-"
#: Where checkpoints that must not be resumed go (damaged, or unmarked and in the way): a folder
#: beside ``checkpoints/``, inside the run directory. Nothing there is deleted by us.
QUARANTINE_DIR = "checkpoints-quarantine"
#: A file written into each quarantined checkpoint: why it was moved, in words.
QUARANTINE_REASON = "quarantine_reason.txt"
_CHUNK = 1 << 20


class UnsafeCheckpointPath(Exception):
    """A checkpoint path that is a symbolic link (or no directory): never written through.

    The supervisor often runs as root; a planted ``checkpoints -> /somewhere`` would put whole
    checkpoints outside the run directory, and rotation would delete directories there.
    """


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
    name = path.name
    if not name.startswith(CHECKPOINT_PREFIX):
        return None
    tail = name[len(CHECKPOINT_PREFIX) :]
    return int(tail) if tail.isdigit() else None


def complete_checkpoints(checkpoints_dir: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Complete checkpoints, oldest first. Temp names and unmarked directories are ignored.

    A checkpoint counts only when its directory carries the final name *and* the marker
    written after every other file: a kill during the write leaves a temp name, which is skipped.
    A symbolic link is never a checkpoint (nor is anything under a linked ``checkpoints_dir``):
    resuming from it, or rotating it, would read or delete what lies outside the run.
    """
    root = Path(checkpoints_dir)
    if not own_directory(root):
        return []
    found: list[tuple[int, Path]] = []
    for child in root.iterdir():
        step = checkpoint_step(child)
        if step is not None and own_directory(child) and (child / CHECKPOINT_COMPLETE_MARKER).is_file():
            found.append((step, child))
    return sorted(found)


def newest_complete_checkpoint(checkpoints_dir: str | os.PathLike[str]) -> tuple[int, Path] | None:
    """The (step, path) of the newest complete checkpoint, or None when there is none."""
    found = complete_checkpoints(checkpoints_dir)
    return found[-1] if found else None


def file_digests(root: Path) -> dict[str, dict[str, Any]]:
    """``{relative path: {"size": bytes, "sha256": hex}}`` of every file under ``root`` but the marker.

    sha256 rather than a CRC: it is in the standard library, a LoRA checkpoint is tens of MB (a
    fraction of a second to hash), and it tells a changed file from an intact one beyond doubt,
    not only a truncated one.
    """
    digests: dict[str, dict[str, Any]] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        name = path.relative_to(root).as_posix()
        if name != CHECKPOINT_COMPLETE_MARKER:
            digests[name] = {"size": path.stat().st_size, "sha256": _sha256(path)}
    return digests


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while chunk := handle.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def read_marker(path: Path) -> dict[str, Any] | None:
    """The completion marker of checkpoint ``path`` as a JSON object; None when unreadable."""
    try:
        marker = json.loads((path / CHECKPOINT_COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return marker if isinstance(marker, dict) else None


def damage(path: Path) -> str | None:
    """Why checkpoint ``path`` does not match its marker, in words; None when it does.

    A marker without a ``files`` entry (written before markers carried checksums, or by hand)
    is accepted: such a checkpoint is verified by loading it (the child reports a load failure
    as :attr:`contract.codes.ExitCode.CHECKPOINT`).
    """
    damaged = damaged_files(path)
    if damaged is None:
        return "its completion marker is unreadable or its file list malformed"
    return "; ".join(f"{name}: {why}" for name, why in sorted(damaged.items())) or None


def damaged_files(path: Path) -> dict[str, str] | None:
    """``{file: why}`` for each file that differs from the marker (empty: intact, or an older
    marker without a file list); None when the marker or its file list cannot be read."""
    marker = read_marker(path)
    if marker is None:
        return None
    files = marker.get("files")
    if files is None:
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
    if _sha256(path) != expected.get("sha256"):
        return "contents differ from the marker's sha256"
    return None


def quarantine_dir(checkpoints_dir: Path) -> Path:
    return checkpoints_dir.parent / QUARANTINE_DIR


def quarantine(path: Path, reason: str) -> Path:
    """Move checkpoint directory ``path`` into the quarantine folder beside its parent; return
    where it went. The rename takes it out of the checkpoint namespace in one step.

    Neither ``path`` nor the folder may be a link (:class:`UnsafeCheckpointPath`): the reason
    file would be written, and the checkpoint moved, outside the run directory.
    """
    if not own_directory(path):
        raise UnsafeCheckpointPath(f"{path} is a symbolic link or no directory; refusing to quarantine it")
    folder = quarantine_dir(path.parent)
    refuse_linked_dir(folder)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / path.name
    if target.exists():
        target = folder / f"{path.name}.{time.time_ns()}"
    os.rename(path, target)
    (target / QUARANTINE_REASON).write_text(reason + "\n", encoding="utf-8")
    return target
