"""Files that survive a kill or a power cut, for both sides: atomic replacement, durable renames."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

#: Mode of the files written here (set explicitly: run files are 0640, whatever the umask).
FILE_MODE = 0o640


def write_text_atomic(path: str | os.PathLike[str], text: str) -> None:
    """Write ``text`` so a reader sees the old file or the whole new one, whatever kills us when."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    # mkstemp opens O_CREAT | O_EXCL | O_NOFOLLOW, the rename replaces a link at ``path``: none is followed.
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    try:
        os.fchmod(fd, FILE_MODE)
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)


def fsync_dir(directory: str | os.PathLike[str]) -> None:
    """Make a rename inside ``directory`` durable (or a file's contents, given a file)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
