"""The layout of a run directory (the job's ``output_dir``). Paths only; no policy."""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.supervisor.record.ownership import foreign_output_dir
from qlora_supervise.supervisor.record.runfiles import (
    UnsafeRunPath,
    open_lock_file,
    prepare_root,
    refuse_linked_dirs,
    refuse_links,
)
from qlora_supervise.trainer_child.contract.checkpoint_dirs import QUARANTINE_DIR


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
    def quarantine(self) -> Path:
        """Where checkpoints that must not be resumed are moved (``checkpoint_dirs.quarantine``)."""
        return self.root / QUARANTINE_DIR

    def attempt_dir(self, number: int) -> Path:
        return self.root / f"attempt-{number:03d}"

    def superseded_checkpoints(self, number: int) -> Path:
        """Where checkpoints go when attempt ``number`` changes the adapter's shape."""
        return self.root / f"checkpoints-before-attempt-{number:03d}"

    def lock(self) -> IO[str]:
        """Hold an exclusive lock on the run directory for the life of the returned file.

        Two supervisors on one run directory would race on the journal and the checkpoints. The
        directory is created 0750, or checked to be ours (see :mod:`.ownership` and :mod:`.runfiles`): a
        system folder, or one holding files but no run of ours, is refused; the lock file is
        never opened through a link, and a run file, ``checkpoints/`` or the quarantine that is a
        link (or holds one) stops the run before anything is written.
        """
        refuse_foreign(self.root, contents=False)  # a system folder, before anything is created
        prepare_root(self.root)
        # Read-only checks first: the lock file is created only in a folder that is safe and ours.
        refuse_links([self.root / ".lock", self.state, self.attempts, self.events, self.job_copy])
        refuse_linked_dirs([self.checkpoints, self.quarantine])
        refuse_foreign(self.root)  # someone else's files
        handle = open_lock_file(self.root / ".lock")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            raise SupervisorExit(
                SupervisorExitCode.BAD_JOB,
                f"another qlora-supervise is running on {self.root} (lock held); "
                "stop it first or choose another output_dir",
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
