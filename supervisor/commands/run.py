"""``qlora-supervise run job.yaml``: load the job once, lock its run directory, run the loop.

Reporting is wired here, at the edge: the console progress, sd_notify, the metrics textfile
and the ``on_event`` hook, as the loop's :class:`Reporter` and the event log's listeners. The
run ends with the same summary ``demo`` prints.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from qlora_supervise.supervisor.commands.summary import print_summary
from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.supervisor.jobfile import Job, JobError, load_job
from qlora_supervise.supervisor.loop.arbiter import Seams, Supervisor
from qlora_supervise.supervisor.loop.settings import policy_settings
from qlora_supervise.supervisor.record.eventlog import Listener, open_event_log
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.reporting import notify
from qlora_supervise.supervisor.reporting.console import ProgressDisplay
from qlora_supervise.supervisor.reporting.hooks import EventHook
from qlora_supervise.supervisor.reporting.reporter import Reporter
from qlora_supervise.supervisor.reporting.service import ServiceStatus
from qlora_supervise.trainer_child.durable import write_text_atomic


def run_job(
    job_path: str,
    plain: bool = False,
    seams: Seams | None = None,
    console: TextIO = sys.stderr,
    install_signals: bool = True,
    summary: TextIO | None = None,
    print_summary_at_end: bool = True,
) -> int:
    """Supervise ``job_path`` to a verdict; returns the exit code (see ``--help``).

    The retry story and how to load the adapter go to ``summary`` (default: stdout) at the end.
    """
    job = _load(job_path)
    run_dir = RunDir(job.output_dir)
    lock = run_dir.lock()
    try:
        reporter, listeners, hook = _reporting(job, console, plain)
        log = open_event_log(run_dir.events, console, listeners)
        if hook is not None:
            hook.log = log
        _keep_job_copy(run_dir, job, log)
        seams = seams or Seams(stop_grace_s=job.supervise.stop_grace)
        supervisor = Supervisor(job, run_dir, log, seams, console, plain, policy_settings(job), reporter)
        if install_signals:
            supervisor.install_signal_handlers()
        notify.ready(f"supervising {job.job_file.name}")
        code = supervisor.run()
        reporter.clear()
        notify.stopping(f"exit {code}")
    finally:
        lock.close()
    if print_summary_at_end:
        print_summary(run_dir, summary or sys.stdout)
    return code


def _reporting(job: Job, console: TextIO, plain: bool) -> tuple[Reporter, list[Listener], EventHook | None]:
    """The reporter the loop ticks and the listeners the event log feeds, from the job's settings."""
    budget = job.resources.gpu_memory_limit or job.resources.cpu_memory_limit
    service = ServiceStatus(job.supervise.max_attempts, budget)
    listeners: list[Listener] = [service.on_event]
    metrics = None
    if job.supervise.metrics_textfile is not None:
        from qlora_supervise.supervisor.reporting.metrics import MetricsTextfile  # only when asked

        metrics = MetricsTextfile(job.supervise.metrics_textfile, job.output_dir.name, budget)
        listeners.append(metrics.on_event)
    hook = None
    if job.supervise.on_event is not None:
        hook = EventHook(job.supervise.on_event, job.supervise.on_event_timeout)
        listeners.append(hook.on_event)
    display = ProgressDisplay(console, plain, job.train.logging_steps)
    return Reporter(display, service, metrics), listeners, hook


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
