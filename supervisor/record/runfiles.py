"""Opening files inside the run directory: never through a symbolic link, with explicit modes.

The supervisor often runs as root (the shipped unit does). A link planted in the run directory
(``.lock -> /etc/passwd``) must not turn its writes into writes elsewhere, so every file it
appends to or creates there is opened with ``O_NOFOLLOW`` (``O_EXCL`` where it must be new),
checked to be a regular file, and given its mode explicitly (the umask can only take bits away,
and differs between a shell and a unit):

* the run directory and the directories in it: :data:`DIR_MODE` (0750);
* the files: :data:`FILE_MODE` (0640).

An ``output_dir`` owned by another user, or writable by others, is refused: anyone who can
write there can plant such links, or edit the journal the supervisor acts on.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, TextIO

from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.trainer_child.contract.checkpoints import DIR_MODE as CHILD_DIR_MODE
from qlora_supervise.trainer_child.contract.durable import FILE_MODE as CHILD_FILE_MODE

# One value each, shared with the child (which sets the same modes on checkpoints, the adapter
# and the merged model): 0750 and 0640.
DIR_MODE = CHILD_DIR_MODE
FILE_MODE = CHILD_FILE_MODE
RUN_UMASK = 0o027  # group may read, others nothing: the modes of DIR_MODE / FILE_MODE
_APPEND = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeRunPath(SupervisorExit):
    """A path in the run directory that the supervisor refuses to write through (exit 2)."""

    def __init__(self, path: Path, why: str, fix: str) -> None:
        super().__init__(SupervisorExitCode.BAD_JOB, f"{path}: {why}; {fix}")
        self.path = path


def prepare_root(root: Path) -> None:
    """Create the run directory (0750) or check an existing one is ours and not writable by others."""
    if not root.exists():
        try:
            root.mkdir(parents=True, mode=DIR_MODE)
            os.chmod(root, DIR_MODE)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS):
                raise  # the caller words a full or read-only disk (run._at_start)
            why = f"cannot create output_dir: {exc.strerror}"
            raise UnsafeRunPath(root, why, "choose a folder this user may create") from None
        return
    info = os.stat(root)
    if not stat.S_ISDIR(info.st_mode):
        raise UnsafeRunPath(root, "output_dir is not a directory", "choose another output_dir")
    if info.st_uid != os.geteuid():
        raise UnsafeRunPath(
            root,
            f"output_dir is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})",
            "run as its owner, or choose an output_dir of your own",
        )
    if info.st_mode & stat.S_IWOTH:
        raise UnsafeRunPath(
            root,
            f"output_dir is writable by others (mode {stat.S_IMODE(info.st_mode):04o})",
            f"run `chmod o-w {root}` (the supervisor makes it {DIR_MODE:04o}), or choose another output_dir",
        )


def refuse_links(paths: list[Path]) -> None:
    """Refuse at start, before anything is run, when one of the run's own files is a link or no file."""
    for path in paths:
        _refuse_link_or_other(path, stat.S_ISREG, "is not a regular file")


def refuse_kind(directories: list[Path]) -> None:
    """Refuse at start when one of the run's own directories is a link or no directory."""
    for path in directories:
        _refuse_link_or_other(path, stat.S_ISDIR, "is not a directory")


def refuse_linked_dirs(paths: list[Path]) -> None:
    """Refuse at start when one of the run's own directories is a link or no directory, or holds a
    link: ``checkpoints/checkpoint-N -> /elsewhere`` would be resumed from, quarantined (a reason
    file written into it) or deleted by rotation, all outside the run directory."""
    for path in paths:
        if not _refuse_link_or_other(path, stat.S_ISDIR, "is not a directory"):
            continue
        for entry in sorted(path.iterdir()):
            if entry.is_symlink():
                raise UnsafeRunPath(
                    entry, "is a symbolic link; refusing to follow or delete through it", _FIX
                )


def _refuse_link_or_other(path: Path, is_kind: Callable[[int], bool], other: str) -> bool:
    """Whether ``path`` exists; raise when it is a link or not of the kind ``is_kind`` accepts."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return False
    if stat.S_ISLNK(info.st_mode):
        raise UnsafeRunPath(path, "is a symbolic link; refusing to write through it", _FIX)
    if not is_kind(info.st_mode):
        raise UnsafeRunPath(path, other, _FIX)
    return True


def ensure_dir(path: Path) -> Path:
    """``path`` as a real directory of ours (created 0750); a link or a file there is refused."""
    try:
        os.mkdir(path, DIR_MODE)
        os.chmod(path, DIR_MODE)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode) or not stat.S_ISDIR(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a directory"
        raise UnsafeRunPath(path, f"is {kind}; the supervisor writes only into its own directories", _FIX)
    return path


def open_append_fd(path: Path, *, exclusive: bool = False) -> int:
    """A read-append descriptor of ``path`` (created 0640), never through a link or onto a non-file."""
    flags = _APPEND | (os.O_EXCL if exclusive else 0)
    try:
        fd = os.open(path, flags, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeRunPath(path, "is a symbolic link; refusing to write through it", _FIX) from None
        raise
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise UnsafeRunPath(path, "is not a regular file", _FIX)
    if stat.S_IMODE(info.st_mode) & ~FILE_MODE:
        os.fchmod(fd, FILE_MODE)  # created by an older version, or under a looser umask
    return fd


def open_append_text(path: Path) -> TextIO:
    """:func:`open_append_fd` as a UTF-8 text file."""
    return os.fdopen(open_append_fd(path), "a", encoding="utf-8")


def open_append_binary(path: Path) -> BinaryIO:
    """:func:`open_append_fd` as a binary file."""
    return os.fdopen(open_append_fd(path), "a+b")


def open_lock_file(path: Path) -> TextIO:
    """The lock file, read-write (created 0640), never through a link."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            why = "is a symbolic link; refusing to lock or write through it"
            raise UnsafeRunPath(path, why, _FIX) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeRunPath(path, "is not a regular file", _FIX)
    os.fchmod(fd, FILE_MODE)
    return os.fdopen(fd, "r+", encoding="utf-8")


_FIX = "remove it (nothing but the supervisor should create entries in a run directory)"
