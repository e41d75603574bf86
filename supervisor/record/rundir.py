"""The layout of a run directory (the job's ``output_dir``): paths, and the lock. :data:`ENTRIES` names
every top-level entry (a test checks a run writes no other); :meth:`RunDir.lock` refuses one that is a
link or of the wrong kind before anything is written."""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.supervisor.facts.append import UnsafeRunPath
from qlora_supervise.supervisor.record.ownership import foreign_output_dir
from qlora_supervise.supervisor.record.runfiles import open_lock_file, prepare_root, refuse_links
from qlora_supervise.trainer_child.contract.checkpoints import QUARANTINE_DIR

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
        base = instance.path if isinstance(instance, AttemptDir) else instance.root
        return base / self.name


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
        """Hold an exclusive lock on the run directory for the life of the returned file.

        The directory is created 0750 or checked to be ours (:mod:`.ownership`, :mod:`.runfiles`);
        a run file, ``checkpoints/`` or the quarantine that is a link (or holds one) stops the run
        before anything is written. ``busy``: the words when another process holds the lock.
        """
        refuse_foreign(self.root, contents=False)  # a system folder, before anything is created
        prepare_root(self.root)
        # Read-only checks first: the lock file is created only in a folder that is safe and ours.
        named = [entry for entry in ENTRIES if not entry.pattern]
        refuse_links([self.root / entry.name for entry in named if not entry.is_dir])
        refuse_links([self.root / entry.name for entry in named if entry.is_dir], directories=True)
        refuse_links([self.checkpoints, self.quarantine], directories=True, inside=True)
        refuse_foreign(self.root)  # someone else's files
        handle = open_lock_file(self.root / ".lock")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            held = f"another qlora-supervise is running on {self.root}"
            raise SupervisorExit(
                SupervisorExitCode.BAD_JOB,
                f"{busy or held} (lock held)"
                + ("" if busy else "; stop it first or choose another output_dir"),
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        return handle


def refuse_foreign(root: Path, contents: bool = True) -> None:
    """Exit 2 when ``root`` may not be a run directory (:func:`.ownership.foreign_output_dir`)."""
    found = foreign_output_dir(root, contents)
    if found is not None:
        raise UnsafeRunPath(root, f"output_dir {found[0]}", found[1])
