"""The layout of a run directory (the job's ``output_dir``): paths, and the lock. :data:`ENTRIES` names every
top-level entry (a test checks a run writes no other); :meth:`RunDir.lock` refuses one that is a link or of
the wrong kind before anything is written. Files inside it are never opened through a symbolic link (the
supervisor often runs as root), with explicit modes (:data:`DIR_MODE` 0750, ``FILE_MODE`` 0640: the umask
differs between a shell and a unit). An ``output_dir`` of another user, or writable by others, is refused; so
is a folder that is not empty and holds no run of ours (a ``state.json`` or ``events.jsonl`` of ours, or a
``.lock`` beside the job copies only): the supervisor moves and deletes entries of its run directory. ``/``,
homes and the system's folders are refused outright. Room on the disk (:func:`room_needed`): after a
``disk_full`` the supervisor frees what killed writers of this run left, then waits for as much room as the
last checkpoint took (at least :data:`MIN_ROOM`)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.supervisor.facts.append import FILE_MODE, LINK_FIX, UnsafeRunPath, open_append_fd
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.jobfile.system_paths import system_folder
from qlora_supervise.supervisor.record.journal import read_state
from qlora_supervise.trainer_child.contract import checkpoints
from qlora_supervise.trainer_child.contract.checkpoints import DIR_MODE, QUARANTINE_DIR, TEMP_PREFIX
from qlora_supervise.trainer_child.contract.disk_space import free_bytes, last_checkpoint_bytes, tree_bytes
from qlora_supervise.trainer_child.contract.processes import pid_alive

RUN_UMASK = 0o027  # group may read, others nothing: the modes of DIR_MODE / FILE_MODE
MERGE_COMMAND = "merge-command"  # ``qlora-supervise merge``'s own spec, log and report
TRAINER_OUTPUT = "trainer-output"  # a foreign tool's own output directory (its final save)
DATASETS_CACHE = "datasets-cache"  # the child's HF_DATASETS_CACHE: prepared data stays in the run


@dataclass(frozen=True)
class Entry:
    """One top-level entry of a run directory: a name, or an ``fnmatch`` pattern for numbered ones."""

    name: str
    is_dir: bool

    @property
    def pattern(self) -> bool:
        return any(c in self.name for c in "*?[")


#: Every top-level entry of a run directory (see the module's docstring).
ENTRIES: tuple[Entry, ...] = (
    *(Entry(n, False) for n in (".lock", "job.yaml", "state.json", "attempts.jsonl", "events.jsonl")),
    *(Entry(n, False) for n in ("spare.log", "job.v*.yaml", "job.v*.json", ".*.tmp")),
    *(Entry(n, True) for n in ("checkpoints", QUARANTINE_DIR, "adapter", "merged", "generations")),
    *(Entry(n, True) for n in (MERGE_COMMAND, TRAINER_OUTPUT, DATASETS_CACHE)),
    *(Entry(n, True) for n in ("attempt-[0-9][0-9][0-9]", "attempt-*.unrecorded-*", "checkpoints-before-*")),
    *(Entry(n, True) for n in ("merged-before-extend-*", ".tmp-*", ".old-*")),
)


class _In:
    """A path property: ``name`` inside the object's ``path`` / ``root``."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, instance: AttemptDir | RunDir | None, owner: type | None = None) -> Path:
        if instance is None:  # on the class: no path
            raise AttributeError(self.name)
        return (instance.path if isinstance(instance, AttemptDir) else instance.root) / self.name


@dataclass(frozen=True)
class AttemptDir:
    """One attempt's directory (``attempt-NNN/``, or ``merge-command/``): the spec the supervisor
    writes, what the child writes back, and what the supervisor samples."""

    path: Path
    spec = _In("spec.json")
    events = _In("child-events.jsonl")
    error = _In("error.json")
    log = _In("child.log")
    gpu = _In("gpu.jsonl")


@dataclass(frozen=True)
class RunDir:
    root: Path
    job_copy = _In("job.yaml")
    state = _In("state.json")
    attempts = _In("attempts.jsonl")
    events = _In("events.jsonl")
    checkpoints = _In("checkpoints")
    adapter = _In("adapter")
    merged = _In("merged")
    merge_command = _In(MERGE_COMMAND)
    datasets_cache = _In(DATASETS_CACHE)
    quarantine = _In(QUARANTINE_DIR)  # checkpoints that must not be resumed (checkpoints.quarantine)

    def attempt_dir(self, number: int) -> Path:
        return self.root / f"attempt-{number:03d}"

    def attempt(self, number: int) -> AttemptDir:
        return AttemptDir(self.attempt_dir(number))

    def superseded_checkpoints(self, number: int) -> Path:
        """Where checkpoints go when attempt ``number`` changes the adapter's shape."""
        return self.root / f"checkpoints-before-attempt-{number:03d}"

    def lock(self, busy: str | None = None) -> IO[str]:
        """Hold an exclusive lock on the run directory for the life of the returned file; the directory
        is created 0750 or checked to be ours (the module's docstring), and a run file, ``checkpoints/``
        or the quarantine that is a link (or holds one) stops the run before anything is written.
        ``busy``: the words when another process holds the lock."""
        refuse_foreign(self.root, contents=False)  # a system folder, before anything is created
        prepare_root(self.root)
        # Read-only checks first: the lock file is created only in a folder that is safe and ours.
        named = [entry for entry in ENTRIES if not entry.pattern]
        refuse_links([self.root / entry.name for entry in named if not entry.is_dir])
        refuse_links([self.root / entry.name for entry in named if entry.is_dir], directories=True)
        refuse_links([self.checkpoints, self.quarantine], directories=True, inside=True)
        refuse_foreign(self.root)  # someone else's files
        fd = open_append_fd(
            self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, "lock or write"
        )
        os.fchmod(fd, FILE_MODE)
        handle = os.fdopen(fd, "r+", encoding="utf-8")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            why = busy or f"another qlora-supervise is running on {self.root}"
            fix = "" if busy else "; stop it first or choose another output_dir"
            raise SupervisorExit(SupervisorExitCode.BAD_JOB, f"{why} (lock held){fix}") from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        return handle


def refuse_foreign(root: Path, contents: bool = True) -> None:
    """Exit 2 when ``root`` may not be a run directory (:func:`foreign_output_dir`)."""
    if (found := foreign_output_dir(root, contents)) is not None:
        raise UnsafeRunPath(root, f"output_dir {found[0]}", found[1])


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
        why = f"output_dir is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
        raise UnsafeRunPath(root, why, "run as its owner, or choose an output_dir of your own")
    if info.st_mode & stat.S_IWOTH:
        why = f"output_dir is writable by others (mode {stat.S_IMODE(info.st_mode):04o})"
        fix = f"run `chmod o-w {root}` (the supervisor makes it {DIR_MODE:04o}), or choose another output_dir"
        raise UnsafeRunPath(root, why, fix)


def refuse_links(paths: list[Path], directories: bool = False, inside: bool = False) -> None:
    """Refuse at start when one of the run's own files (``directories``: directories) is a link or of
    another kind; ``inside``: a directory holding a link too (``checkpoints/checkpoint-N ->
    /elsewhere`` would be resumed, quarantined or deleted outside the run directory)."""
    is_kind = stat.S_ISDIR if directories else stat.S_ISREG
    other = "is not a directory" if directories else "is not a regular file"
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


_FIRST_FILES = re.compile(r"\.lock|job\.yaml|job\.v\d+\.(yaml|json)")


def foreign_output_dir(root: Path, contents: bool = True) -> tuple[str, str] | None:
    """Why ``root`` may not be a run directory and the fix, or None; ``contents`` False: only
    where it is (a system folder, a home), not what it holds."""
    if (found := system_folder(root)) is not None or not contents:
        return found
    real = Path(os.path.realpath(root))
    if not real.is_dir() or is_run_dir(real):
        return None
    return (
        "exists, is not empty and holds no run of qlora-supervise (no state.json or events.jsonl of "
        "ours); the supervisor would move, replace or delete the files there",
        f"choose a new or empty folder for output_dir (for example a subfolder, such as {real}/run), "
        "or give the path of this run's own output_dir",
    )


def is_run_dir(root: Path) -> bool:
    """Whether ``root`` is empty or holds a run of ours (see the module's docstring)."""
    try:
        names = [entry.name for entry in os.scandir(root)]
    except OSError:
        return False
    state, events = root / "state.json", root / "events.jsonl"
    if not names or (state.is_file() and not state.is_symlink() and read_state(state) is not None):
        return True
    if events.is_file() and not events.is_symlink():  # its first line is an event of ours
        try:
            with events.open("rb") as handle:
                record = json.loads(handle.readline(64 * 1024))
        except (OSError, ValueError):
            record = None
        if isinstance(record, dict) and {"event", "level"} <= record.keys():
            return True
    return ".lock" in names and all(_FIRST_FILES.fullmatch(name) for name in names)


MIN_ROOM = 1 << 20  # a journal line, a state file, an error report and some events


def room_needed(rd: RunDir, reported: int | None = None) -> int:
    """Bytes to wait for: what the child said it needs, the last checkpoint's size, or the minimum."""
    return max(MIN_ROOM, reported or 0, last_checkpoint_bytes(rd.checkpoints) or 0)


def room_free(rd: RunDir) -> int:
    """Bytes the run may still write on its disk (0 on a read-only mount)."""
    return free_bytes(rd.checkpoints if rd.checkpoints.exists() else rd.root)


def free_ours(rd: RunDir) -> int:
    """Delete the staging directories, adapter temps and atomic writes' temp files that killed
    writers left (the caller holds the run's lock); returns the bytes freed."""
    freed = 0
    if rd.checkpoints.is_dir() and not rd.checkpoints.is_symlink():  # never sized or pruned through a link
        temps = [path for path in rd.checkpoints.iterdir() if path.name.startswith(TEMP_PREFIX)]
        sizes = {path: tree_bytes(path) for path in temps}
        gone = checkpoints.remove_stale_temps(rd.checkpoints)
        freed += sum(sizes.get(path, 0) for path in gone)
    folders = [rd.root, *sorted(rd.root.glob("attempt-*"))]
    real = [folder for folder in folders if folder.is_dir() and not folder.is_symlink()]
    for path in [path for folder in real for path in folder.iterdir() if _stale(path)]:
        freed += tree_bytes(path) if path.is_dir() else path.stat().st_size
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
    return freed


def _stale(path: Path) -> bool:
    name, tail = path.name, path.name.rsplit("-", 1)[-1]
    if name.startswith(".") and name.endswith(".tmp"):
        return path.is_file()  # write_text_atomic's temp file, left by a kill mid-write
    swapped = name.startswith((".tmp-adapter-", ".old-adapter-", ".tmp-merged-", ".old-merged-"))
    return swapped and tail.isdigit() and not pid_alive(int(tail))


def room_words(rd: RunDir, needed: int, free: int) -> str:
    """The sentence for people: where, how much is free, how much is needed and why, what to do."""
    where = rd.checkpoints if rd.checkpoints.exists() else rd.root
    if free == 0 and not os.access(where, os.W_OK):
        return f"{where} is read-only: remount it writable (the run needs {format_bytes(needed)} there)"
    last = last_checkpoint_bytes(rd.checkpoints)
    basis = "the size of the last checkpoint" if last and needed <= last else "the journal, state and reports"
    return (
        f"the disk holding {where} has {format_bytes(free)} free; the run needs {format_bytes(needed)} "
        f"there ({basis}): free {format_bytes(max(0, needed - free))} or more"
    )
