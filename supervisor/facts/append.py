"""Appending to the run directory's files, fsynced line by line and never through a symbolic link
(a supervisor running as root must not follow a planted link): ``O_NOFOLLOW``, a regular file only,
and :data:`FILE_MODE` set explicitly (the umask differs between a shell and a unit)."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import BinaryIO, TextIO

from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.trainer_child.contract.durable import FILE_MODE as FILE_MODE  # re-exported
from qlora_supervise.trainer_child.contract.durable import fsync_dir

_APPEND = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
LINK_FIX = "remove it (nothing but the supervisor should create entries in a run directory)"


class UnsafeRunPath(SupervisorExit):
    """A path in the run directory that the supervisor refuses to write through (exit 2)."""

    def __init__(self, path: Path, why: str, fix: str) -> None:
        super().__init__(SupervisorExitCode.BAD_JOB, f"{path}: {why}; {fix}")
        self.path = path


def open_append_fd(path: Path, flags: int = _APPEND, act: str = "write") -> int:
    """A descriptor of ``path`` (default: read-append; created 0640), never through a link or a non-file."""
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeRunPath(path, f"is a symbolic link; refusing to {act} through it", LINK_FIX) from None
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
    """Append one line and fsync it; a line torn by an earlier kill is closed first."""
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
