"""The layout of a run directory (the job's ``output_dir``). Paths only; no policy.

:data:`ENTRIES` names every entry the supervisor, its child or a tool writes at the top of a run
directory. Each is opened through :mod:`.runfiles`' no-follow helpers (``ensure_dir``,
``open_append_*``, ``write_text_atomic``'s rename), and :meth:`RunDir.lock` refuses a run whose
named entry is a link or of the wrong kind before anything is written. A test plants a link at
each entry of the tuple, and checks that a run writes no top-level name the tuple lacks: an entry
added later is registered here or that test fails.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.supervisor.facts.append import UnsafeRunPath
from qlora_supervise.supervisor.record.ownership import foreign_output_dir
from qlora_supervise.supervisor.record.runfiles import (
    open_lock_file,
    prepare_root,
    refuse_kind,
    refuse_linked_dirs,
    refuse_links,
)
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


@dataclass(frozen=True)
class AttemptDir:
    """One attempt's directory (``attempt-NNN/``, or ``merge-command/``) and the files in it: the
    spec the supervisor writes, what the child writes back, and what the supervisor samples."""

    path: Path

    @property
    def spec(self) -> Path:
        return self.path / "spec.json"

    @property
    def events(self) -> Path:
        return self.path / "child-events.jsonl"

    @property
    def error(self) -> Path:
        return self.path / "error.json"

    @property
    def log(self) -> Path:
        return self.path / "child.log"

    @property
    def gpu(self) -> Path:
        return self.path / "gpu.jsonl"


@dataclass(frozen=True)
class RunDir:
    root: Path

    @property
    def job_copy(self) -> Path:
        return self.root / "job.yaml"

    @property
    def state(self) -> Path:
        return self.root / "state.json"

    @property
    def attempts(self) -> Path:
        return self.root / "attempts.jsonl"

    @property
    def events(self) -> Path:
        return self.root / "events.jsonl"

    @property
    def checkpoints(self) -> Path:
        return self.root / "checkpoints"

    @property
    def adapter(self) -> Path:
        return self.root / "adapter"

    @property
    def merged(self) -> Path:
        return self.root / "merged"

    @property
    def merge_command(self) -> Path:
        return self.root / MERGE_COMMAND

    @property
    def trainer_output(self) -> Path:
        return self.root / TRAINER_OUTPUT

    @property
    def datasets_cache(self) -> Path:
        return self.root / DATASETS_CACHE

    @property
    def quarantine(self) -> Path:
        """Where checkpoints that must not be resumed are moved (``checkpoints.quarantine``)."""
        return self.root / QUARANTINE_DIR

    def attempt_dir(self, number: int) -> Path:
        return self.root / f"attempt-{number:03d}"

    def attempt(self, number: int) -> AttemptDir:
        return AttemptDir(self.attempt_dir(number))

    def superseded_checkpoints(self, number: int) -> Path:
        """Where checkpoints go when attempt ``number`` changes the adapter's shape."""
        return self.root / f"checkpoints-before-attempt-{number:03d}"

    def lock(self, busy: str | None = None) -> IO[str]:
        """Hold an exclusive lock on the run directory for the life of the returned file.

        Two supervisors on one run directory would race on the journal and the checkpoints. The
        directory is created 0750, or checked to be ours (see :mod:`.ownership` and :mod:`.runfiles`): a
        system folder, or one holding files but no run of ours, is refused; the lock file is
        never opened through a link, and a run file, ``checkpoints/`` or the quarantine that is a
        link (or holds one) stops the run before anything is written. ``busy``: the words when
        another process holds the lock (``merge`` says to wait for the run).
        """
        refuse_foreign(self.root, contents=False)  # a system folder, before anything is created
        prepare_root(self.root)
        # Read-only checks first: the lock file is created only in a folder that is safe and ours.
        named = [entry for entry in ENTRIES if not entry.pattern]
        refuse_links([self.root / entry.name for entry in named if not entry.is_dir])
        refuse_kind([self.root / entry.name for entry in named if entry.is_dir])
        refuse_linked_dirs([self.checkpoints, self.quarantine])  # and the links in them
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
