"""Appending to the run directory's files: never through a symbolic link, fsynced line by line.

The supervisor often runs as root; a link planted in the run directory must not turn its
appends into writes elsewhere, so every file it appends to is opened with ``O_NOFOLLOW``,
checked to be a regular file, and given :data:`FILE_MODE` explicitly (the umask differs
between a shell and a unit). ``record.runfiles`` holds the rest of the run directory's rules.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO, TextIO

from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.trainer_child.contract.durable import FILE_MODE, fsync_dir

__all__ = [
    "FILE_MODE",
    "LINK_FIX",
    "UnsafeRunPath",
    "append_line",
    "open_append_binary",
    "open_append_fd",
    "open_append_text",
]

_APPEND = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
LINK_FIX = "remove it (nothing but the supervisor should create entries in a run directory)"


class UnsafeRunPath(SupervisorExit):
    """A path in the run directory that the supervisor refuses to write through (exit 2)."""

    def __init__(self, path: Path, why: str, fix: str) -> None:
        super().__init__(SupervisorExitCode.BAD_JOB, f"{path}: {why}; {fix}")
        self.path = path


def open_append_fd(path: Path, *, exclusive: bool = False) -> int:
    """A read-append descriptor of ``path`` (created 0640), never through a link or onto a non-file."""
    flags = _APPEND | (os.O_EXCL if exclusive else 0)
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeRunPath(path, "is a symbolic link; refusing to write through it", LINK_FIX) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UnsafeRunPath(path, "is not a regular file", LINK_FIX)
    if stat.S_IMODE(info.st_mode) & ~FILE_MODE:
        os.fchmod(fd, FILE_MODE)  # created by an older version, or under a looser umask
    return fd


def open_append_text(path: Path) -> TextIO:
    """:func:`open_append_fd` as a UTF-8 text file."""
    return os.fdopen(open_append_fd(path), "a", encoding="utf-8")


def open_append_binary(path: Path) -> BinaryIO:
    """:func:`open_append_fd` as a binary file."""
    return os.fdopen(open_append_fd(path), "a+b")


def append_line(path: Path, line: str) -> None:
    """Append one line and fsync it (and a new file's directory entry).

    A line torn by an earlier kill is closed first, so it stays one unreadable line instead of
    swallowing this one.
    """
    created = not path.exists()
    with open_append_binary(path) as handle:
        handle.seek(0, os.SEEK_END)
        if handle.tell() > 0:
            handle.seek(-1, os.SEEK_END)
            if handle.read(1) != b"\n":
                handle.write(b"\n")
        handle.write(line.encode("utf-8"))
        handle.flush()
        os.fsync(handle.fileno())
    if created:
        fsync_dir(path.parent)
