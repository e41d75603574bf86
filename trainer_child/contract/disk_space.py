"""Room on the disk for a checkpoint, checked by the child before each save and by the supervisor
when it waits for space: about as much as the last one took (before the first, the save finds out)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
from pathlib import Path
from typing import Any

from qlora_supervise.trainer_child.contract.checkpoints import newest_complete_checkpoint

#: errno values that mean "no room to write here": a full disk, a read-only mount, a quota.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EROFS, errno.EDQUOT})


class NoRoomForCheckpoint(OSError):
    """Raised before a save that would not fit: ENOSPC, with the numbers in the message."""


def is_disk_full(exc: BaseException) -> bool:
    """``exc`` or one of its causes is an OSError of :data:`DISK_ERRNOS`."""
    return any(isinstance(item, OSError) and item.errno in DISK_ERRNOS for item in exception_chain(exc))


def tree_bytes(root: Path) -> int:
    """Bytes of the regular files under ``root`` (links not followed)."""
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):  # deleted while we walked (rotation)
                total += os.lstat(os.path.join(directory, name)).st_size
    return total


def last_checkpoint_bytes(checkpoints_dir: str | os.PathLike[str]) -> int | None:
    """The size of the newest complete checkpoint: what the next one will need. None: none yet."""
    newest = newest_complete_checkpoint(checkpoints_dir)
    return tree_bytes(newest[1]) if newest else None


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes a writer may still use at ``path`` (0 on a read-only file system)."""
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    # access() says EROFS for a read-only mount, whatever statvfs says is free
    return shutil.disk_usage(where).free if os.access(where, os.W_OK) else 0


def ensure_room(checkpoints_dir: str | os.PathLike[str]) -> None:
    """Raise :class:`NoRoomForCheckpoint` when the disk cannot hold another checkpoint like the last."""
    needed = last_checkpoint_bytes(checkpoints_dir)
    if needed is not None and (free := free_bytes(checkpoints_dir)) < needed:
        raise NoRoomForCheckpoint(
            errno.ENOSPC,
            f"no room for a checkpoint in {checkpoints_dir}: it needs {needed} bytes "
            f"(the size of the last one), {free} bytes are free",
        )


def disk_facts(checkpoints_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """The error report's ``disk``: where, how much is needed and how much is free."""
    return {
        "path": str(checkpoints_dir),
        "needed_bytes": last_checkpoint_bytes(checkpoints_dir),
        "free_bytes": free_bytes(checkpoints_dir),
    }


def exception_chain(exc: BaseException) -> list[BaseException]:
    """The exception and its causes (libraries wrap OOMs and ENOSPC in errors of their own)."""
    seen: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in seen:
        seen.append(current)
        current = current.__cause__ or current.__context__
    return seen
