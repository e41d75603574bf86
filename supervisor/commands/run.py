"""``qlora-supervise run job.yaml``: load the job once, lock its run directory, wire the reporting (the
loop's :class:`Reporter` and the event log's listeners), run the loop, print the summary."""

from __future__ import annotations

import dataclasses
import errno
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO, TypeVar

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.commands import BadInput
from qlora_supervise.supervisor.commands.status import print_summary
from qlora_supervise.supervisor.commands.validate import load_or_exit
from qlora_supervise.supervisor.jobfile import Job
from qlora_supervise.supervisor.jobfile.advice import job_advice
from qlora_supervise.supervisor.jobfile.job import TRUST_REMOTE_CODE_WARNING
from qlora_supervise.supervisor.loop.arbiter import Seams, Supervisor
from qlora_supervise.supervisor.loop.settings import policy_settings
from qlora_supervise.supervisor.record import generations
from qlora_supervise.supervisor.record.eventlog import Listener, open_event_log
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.journal import Lift, RunState, append_lift, read_attempts, read_state
from qlora_supervise.supervisor.record.rundir import RUN_UMASK, RunDir
from qlora_supervise.supervisor.reporting import notify, outputs
from qlora_supervise.supervisor.reporting.console import ConsoleStream, ProgressDisplay, best_effort
from qlora_supervise.supervisor.reporting.notify import ServiceStatus
from qlora_supervise.supervisor.trainers.trainer import tool_advice
from qlora_supervise.trainer_child.contract.disk_space import is_disk_full


def run_job(
    job_path: str,
    plain: bool = False,
    seams: Seams | None = None,
    console: TextIO = sys.stderr,
    install_signals: bool = True,
    as_written: bool = False,
    restart: bool = False,
    retry: bool = False,
    summary: TextIO | None = None,
) -> int:
    """Supervise ``job_path`` to a verdict; returns the exit code (see ``--help``, which also says what
    ``as_written``, ``restart`` and ``retry`` do). The summary goes to ``summary`` (default: stdout)."""
    # Long because the start of a run is a sequence whose order matters (lock, reconcile the job,
    # open the log, lift a verdict, then the loop); each step is one call below.
    job = load_or_exit(job_path, tail=f"\n(run `qlora-supervise validate {job_path}`)", tools=True)
    console, console_stream = best_effort(console)  # a closed pipe costs the console, not the run
    os.umask(RUN_UMASK)  # for what the child's libraries create (checkpoints): 0640 / 0750 too
    run_dir = RunDir(job.output_dir)
    with _at_start(run_dir, run_dir.lock):
        reporter, listeners = _reporting(job, console, plain, console_stream)
        submitted = _at_start(run_dir, lambda: reconcile(run_dir, job, restart))
        log = _at_start(run_dir, lambda: open_event_log(run_dir.events, console, listeners))
        reporter.bind(log)
        if submitted.changes:
            lines = "\n".join(change.render(submitted.restarting) for change in submitted.changes)
            how = ", in a new generation (--restart)" if submitted.restarting else ""
            print(f"job changed (now job.v{submitted.version}.yaml{how}):\n{lines}", file=console, flush=True)
            changes = {change.name: change.to_json() for change in submitted.changes}
            log.warning(Event.JOB_CHANGED, version=submitted.version, changes=changes)
        if submitted.previous_generation is not None:
            log.info(Event.GENERATION_STARTED, previous_generation=str(submitted.previous_generation))
        _at_start(run_dir, lambda: _lift_verdict(run_dir, submitted, retry, log))
        if job.train.trust_remote_code:
            log.warning(Event.TRUST_REMOTE_CODE, model=job.knobs.model, why=TRUST_REMOTE_CODE_WARNING)
        for advice in [*job_advice(job, records=None), *tool_advice(job.trainer)]:  # validate's warnings
            log.warning(Event.JOB_ADVICE, field=advice.field, what=advice.what, fix=advice.fix)
        seams = seams or Seams(stop_grace_s=job.supervise.stop_grace)
        settings = policy_settings(job)
        supervisor = Supervisor(job, run_dir, log, seams, console, plain, settings, reporter, as_written)
        if install_signals:
            supervisor.install_signal_handlers()
        notify.ready(f"supervising {job.job_file.name}")
        code = supervisor.run()
        reporter.clear()
        notify.stopping(f"exit {code}")
    print_summary(run_dir, summary or best_effort(sys.stdout)[0])
    return code


def _reporting(
    job: Job, console: TextIO, plain: bool, console_stream: ConsoleStream
) -> tuple[outputs.Reporter, list[Listener]]:
    """The loop's reporter and the event log's listeners, each output run through one ``BestEffort``."""
    budget = job.resources.gpu_memory_limit or job.resources.cpu_memory_limit
    best = outputs.BestEffort()
    service = ServiceStatus(job.supervise.max_attempts, budget)
    listeners: list[Listener] = [
        best.listener(outputs.SYSTEMD, service.on_event),
        best.listener(outputs.CONSOLE, lambda _event: console_stream.check()),
    ]
    metrics = None
    if job.supervise.metrics_textfile is not None:
        metrics = outputs.MetricsTextfile(job.supervise.metrics_textfile, job.output_dir.name, budget)
        listeners.append(best.listener(outputs.METRICS_TEXTFILE, metrics.on_event))
    if job.supervise.on_event is not None:
        hook = outputs.EventHook(job.supervise.on_event, job.supervise.on_event_timeout, best)
        listeners.append(best.listener(outputs.ON_EVENT, hook.on_event))
    display = ProgressDisplay(console, plain, job.train.logging_steps)
    return outputs.Reporter(display, service, metrics, best), listeners


_T = TypeVar("_T")


def _at_start(run_dir: RunDir, action: Callable[[], _T]) -> _T:
    """``action()``; a run directory with no room, or read-only, before anything ran is exit 2 in words."""
    try:
        return action()
    except OSError as exc:
        if not is_disk_full(exc):
            raise
        fix = "remount it writable" if exc.errno == errno.EROFS else "free space there"
        why = f"cannot write the run directory ({exc.strerror}): {fix}, or choose another output_dir"
        raise BadInput(f"{run_dir.root}: {why}") from None


@dataclass(frozen=True)
class Submission:
    """What ``run`` found when it compared the job with the run directory's record."""

    changes: list[generations.FieldChange]
    version: int | None  # the job version recorded now; None: the job is the recorded one
    previous_generation: Path | None  # where --restart moved the last generation
    restarting: bool = False  # run --restart: the changes start a new generation, not a resume


def reconcile(rd: RunDir, job: Job, restart: bool) -> Submission:
    """Compare ``job`` with the newest recorded version; record it; move a generation aside if asked.
    Refuses (exit 2, with the diff and the flag) a change of what is trained without ``restart``."""
    moved = generations.finish_interrupted_move(rd)
    versions = generations.JobVersions(rd)
    if (recorded := versions.newest_view()) is None:
        return Submission([], versions.record(job), moved)
    changes = generations.diff(recorded, generations.job_view(job))
    # Before the first optimizer step a tool's own key has nothing to mix with yet (generations.py).
    if not any(record.steps_completed > 0 for record in read_attempts(rd.attempts)[0]):
        changes = [dataclasses.replace(change, untrained=True) for change in changes]
    unsafe = [change for change in changes if not change.safe]
    if restart and generations.has_attempts(rd):
        moved = generations.start_generation(rd)
    elif unsafe and not restart:
        lines = "\n".join(change.render() for change in changes)
        raise BadInput(
            f"{job.job_file} differs from the job {rd.root} was trained with:\n{lines}\n"
            f"{len(unsafe)} change(s) would mix two trainings in one adapter. To train the new job in "
            f"the same output_dir, run `qlora-supervise run --restart {job.job_file}` (a new generation; "
            f"the current one is kept in {rd.root / 'generations'}/), or put the old values back",
        )
    if not changes and not (restart and moved):
        return Submission([], None, moved)
    return Submission(changes, versions.record(job), moved, restart)


def _lift_verdict(rd: RunDir, submitted: Submission, retry: bool, log: FilteringBoundLogger) -> None:
    """A verdict other than success is lifted by ``--retry`` or a changed job; the journal says so."""
    if (state := read_state(rd.state)) is not None and state.run_state is RunState.SUCCEEDED:
        # A raised max_steps / epochs extends a finished run from its last checkpoint (issue 21 item 13).
        if (extended := generations.extend_finished(rd, submitted.changes, time.time())) is not None:
            lifted = {"after_attempt": extended.after_attempt, "why": extended.why}
            log.info(Event.VERDICT_LIFTED, verdict="succeeded", **lifted)
        return
    records, _ = read_attempts(rd.attempts)
    if state is None or state.run_state not in (RunState.GAVE_UP, RunState.FAILED) or not records:
        return
    if not (retry or submitted.changes):
        return
    names = ", ".join(change.name for change in submitted.changes)
    why = "run --retry" if retry else f"the job changed: {names}"
    append_lift(rd.attempts, Lift(records[-1].attempt, state.run_state.value, why, time.time()))
    log.info(Event.VERDICT_LIFTED, verdict=state.run_state.value, after_attempt=records[-1].attempt, why=why)
