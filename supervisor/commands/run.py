"""``qlora-supervise run job.yaml``: load the job once, lock its run directory, run the loop."""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Callable
from typing import Any, TextIO, TypeVar

from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.supervisor.jobfile import Job, JobError, load_job
from qlora_supervise.supervisor.loop.arbiter import Seams, Supervisor
from qlora_supervise.supervisor.loop.settings import policy_settings
from qlora_supervise.supervisor.record.eventlog import open_event_log
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.reporting import notify
from qlora_supervise.trainer_child.disk_space import is_disk_full
from qlora_supervise.trainer_child.durable import write_text_atomic

RUN_UMASK = 0o027  # group may read, others nothing: the modes of runfiles.DIR_MODE / FILE_MODE


def run_job(
    job_path: str,
    plain: bool = False,
    seams: Seams | None = None,
    console: TextIO = sys.stderr,
    install_signals: bool = True,
) -> int:
    """Supervise ``job_path`` to a verdict; returns the exit code (see ``--help``)."""
    job = _load(job_path)
    # Files the child's libraries create (checkpoints, tokenizer files) get 0640 / 0750 too:
    # the supervisor sets its own files' modes explicitly, and this covers what it cannot.
    os.umask(RUN_UMASK)
    run_dir = RunDir(job.output_dir)
    lock = _at_start(run_dir, run_dir.lock)
    try:
        log = _at_start(run_dir, lambda: open_event_log(run_dir.events, console))
        _at_start(run_dir, lambda: _keep_job_copy(run_dir, job, log))
        supervisor = Supervisor(job, run_dir, log, seams, console, plain, policy_settings(job))
        if install_signals:
            supervisor.install_signal_handlers()
        notify.ready()
        code = supervisor.run()
        notify.stopping()
        return code
    finally:
        lock.close()


_T = TypeVar("_T")


def _at_start(run_dir: RunDir, action: Callable[[], _T]) -> _T:
    """``action()``; a run directory with no room, or read-only, before anything ran is exit 2 in words."""
    try:
        return action()
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        fix = "remount it writable" if exc.errno == errno.EROFS else "free space there"
        raise SupervisorExit(
            SupervisorExitCode.BAD_JOB,
            f"{run_dir.root}: cannot write the run directory ({exc.strerror}): {fix}, "
            "or choose another output_dir",
        ) from None


def _load(job_path: str) -> Job:
    try:
        return load_job(job_path)
    except JobError as error:
        lines = "\n".join(problem.render() for problem in error.problems)
        raise SupervisorExit(
            SupervisorExitCode.BAD_JOB,
            f"{job_path}: {len(error.problems)} problem(s):\n{lines}\n"
            f"(run `qlora-supervise validate {job_path}`)",
        ) from None


def _keep_job_copy(run_dir: RunDir, job: Job, log: Any) -> None:
    previous = run_dir.job_copy.read_text(encoding="utf-8") if run_dir.job_copy.exists() else None
    if previous is not None and previous != job.raw_text:
        # The first submission stays beside the new one so the journal's early attempts stay explained.
        keep = run_dir.root / "job.previous.yaml"
        write_text_atomic(keep, previous)
        log.warning(Event.JOB_CHANGED, kept_previous=str(keep))
    write_text_atomic(run_dir.job_copy, job.raw_text)
