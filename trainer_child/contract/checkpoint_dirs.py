"""Checkpoint directory names and which of them count as complete: the child writes checkpoints
(:mod:`.checkpoints`), the supervisor picks the one to resume from, by the same names."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from pathlib import Path
from typing import Any

#: Written last into a complete checkpoint: lets a reader reject a copied or truncated directory.
CHECKPOINT_COMPLETE_MARKER = "qlora_supervise_complete.json"
CHECKPOINT_PREFIX = "checkpoint-"
#: Beside ``checkpoints/``: checkpoints that must not be resumed; nothing there is deleted by us.
QUARANTINE_DIR = "checkpoints-quarantine"
QUARANTINE_REASON = "quarantine_reason.txt"
_CHUNK = 1 << 20


class UnsafeCheckpointPath(Exception):
    """A checkpoint path that is a symbolic link (or no directory): never written through (the
    supervisor often runs as root; rotation would delete directories where a link points)."""


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
    """Complete checkpoints (the final name *and* the marker), oldest first; temp names, unmarked
    directories and symbolic links (or anything under a linked ``checkpoints_dir``) are not."""
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
    """``{relative path: {"size": bytes, "sha256": hex}}`` of every file under ``root`` but the
    marker (a LoRA checkpoint hashes in a fraction of a second; sha256 catches any change)."""
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


def damaged_files(path: Path) -> dict[str, str] | None:
    """``{file: why}`` for each file that differs from the marker (empty: intact, or a marker
    without a file list, verified by loading); None when the marker or its list is unreadable."""
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


def quarantine(path: Path, reason: str) -> Path:
    """Move checkpoint directory ``path`` into the quarantine folder beside its parent (one
    rename), with the reason in a file; return where it went. Neither may be a link."""
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
