"""Opening files inside the run directory: never through a symbolic link (the supervisor often runs
as root), with explicit modes (:data:`DIR_MODE` 0750, ``FILE_MODE`` 0640: the umask differs between a
shell and a unit). An ``output_dir`` of another user, or writable by others, is refused."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import TextIO

from qlora_supervise.supervisor.facts.append import FILE_MODE, LINK_FIX, UnsafeRunPath
from qlora_supervise.trainer_child.contract.checkpoints import DIR_MODE as CHILD_DIR_MODE

DIR_MODE = CHILD_DIR_MODE  # one value, shared with the child's checkpoints and adapter
RUN_UMASK = 0o027  # group may read, others nothing: the modes of DIR_MODE / FILE_MODE


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


def refuse_links(paths: list[Path], directories: bool = False, inside: bool = False) -> None:
    """Refuse at start when one of the run's own files (``directories``: directories) is a link or of
    another kind; ``inside``: a directory holding a link too (``checkpoints/checkpoint-N ->
    /elsewhere`` would be resumed, quarantined or deleted outside the run directory)."""
    is_kind, other = (
        (stat.S_ISDIR, "is not a directory") if directories else (stat.S_ISREG, "is not a regular file")
    )
    for path in paths:
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(info.st_mode):
            raise UnsafeRunPath(path, "is a symbolic link; refusing to write through it", LINK_FIX)
        if not is_kind(info.st_mode):
            raise UnsafeRunPath(path, other, LINK_FIX)
        for entry in sorted(path.iterdir()) if inside else ():
            if entry.is_symlink():
                why = "is a symbolic link; refusing to follow or delete through it"
                raise UnsafeRunPath(entry, why, LINK_FIX)


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
        raise UnsafeRunPath(path, f"is {kind}; the supervisor writes only into its own directories", LINK_FIX)
    return path


def open_lock_file(path: Path) -> TextIO:
    """The lock file, read-write (created 0640), never through a link."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            why = "is a symbolic link; refusing to lock or write through it"
            raise UnsafeRunPath(path, why, LINK_FIX) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UnsafeRunPath(path, "is not a regular file", LINK_FIX)
    os.fchmod(fd, FILE_MODE)
    return os.fdopen(fd, "r+", encoding="utf-8")
