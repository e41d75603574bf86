"""The arbiter: runs one job's run directory to a verdict, one attempt at a time.

Single-threaded and boring (gunicorn's arbiter, torchelastic's agent): signal handlers only
set a flag; the planner says what runs next, the runner runs it, the outcome is judged, the
policy decides, the journal records, and only then does the loop act. The states, as written
to ``state.json``::

    STARTING -> RUNNING ---------------------------> SUCCEEDED        (adapter; merged if asked)
                  |  child failed -> decide:
                  |     Wait     -> WAITING -> decide again
                  |     Restart  -> BACKOFF (unchanged config only) -> RUNNING
                  |     GiveUp   -> GAVE_UP | FAILED
    any -> STOPPED (SIGTERM/SIGINT; resumable: the same command continues)

Crash safety: every decision is appended to ``attempts.jsonl`` (fsynced) before it is acted
on, and ``state.json`` names the attempt in flight. Started again after a kill at any moment,
the arbiter reclaims the in-flight attempt and continues from the journal's last decision, so
a config that failed is never run again the same way.
"""

from __future__ import annotations

import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any, TextIO

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.rungs import Survives
from qlora_supervise.supervisor.diagnosis.failure import Failure
from qlora_supervise.supervisor.exit_codes import SupervisorExitCode
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.loop.announce import announce_decision, announce_plan, announce_success
from qlora_supervise.supervisor.loop.disk_wait import DiskWaiter
from qlora_supervise.supervisor.loop.first_plan import first_plan
from qlora_supervise.supervisor.loop.outcome import AttemptOutcome, failure_record, judge, record_of
from qlora_supervise.supervisor.loop.planner import Plan, PlanFacts, Verdict, next_plan
from qlora_supervise.supervisor.loop.reclaim import reclaim
from qlora_supervise.supervisor.loop.resume import (
    clean_staging,
    log_quarantined,
    quarantine_reported,
    resume_point,
)
from qlora_supervise.supervisor.loop.runner import AttemptRunner, RunnerContext
from qlora_supervise.supervisor.loop.seams import Seams
from qlora_supervise.supervisor.loop.settings import (
    peak_store_path,
    step_fit,
    with_card_budget,
    with_sample_lengths,
)
from qlora_supervise.supervisor.loop.waiting import backoff_seconds, wait_for_memory
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.history import policy_history
from qlora_supervise.supervisor.record.journal import (
    RunState,
    State,
    append_attempt,
    lifted_after,
    read_attempts,
    read_state,
    write_state,
)
from qlora_supervise.supervisor.record.peak_store import record_peak
from qlora_supervise.supervisor.record.records import (
    AttemptRecord,
    DecisionRecord,
    Outcome,
    Phase,
)
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.reporting import notify
from qlora_supervise.supervisor.reporting.console import ProgressDisplay
from qlora_supervise.supervisor.reporting.reporter import Reporter
from qlora_supervise.supervisor.watching.gpu import GpuProbe
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.disk_space import is_disk_full
from qlora_supervise.trainer_child.contract.spec import Knobs

_DAMAGED = FailureKind.CHECKPOINT_DAMAGED
_ENDED = {
    RunState.SUCCEEDED: SupervisorExitCode.FINISHED,
    RunState.GAVE_UP: SupervisorExitCode.GAVE_UP,
    RunState.FAILED: SupervisorExitCode.NOT_RETRYABLE,
}
ENDED_FIX = (
    "the verdict stands until the job changes: fix the job and run it again (a field that changes "
    "what is trained needs `run --restart`, a new generation in the same output_dir), or "
    "`run --retry` to try the last config once more"
)


class Supervisor:
    """Runs one job's run directory to a verdict. ``run()`` returns the process exit code."""

    def __init__(
        self,
        job: Job,
        run_dir: RunDir,
        log: Any,
        seams: Seams | None = None,
        console: TextIO = sys.stderr,
        plain: bool = False,
        settings: policy.Settings | None = None,
        reporter: Reporter | None = None,
        as_written: bool = False,
    ) -> None:
        self.job = job
        self.as_written = as_written
        self.settings = settings or policy.Settings()
        self.rd = run_dir
        self.log = log
        self.seams = seams or Seams()
        self.display = reporter or Reporter(ProgressDisplay(console, plain))
        self.stop_signal: int | None = None
        self.stop_event = threading.Event()  # the same request, for tenacity's stop condition
        self.hup_seen = False
        self._watchdog_every = notify.watchdog_interval_s()
        self._last_ping = -1e18
        self.gpu: GpuProbe | None = None
        self.lifted_after = 0  # attempts up to this one had a verdict that was lifted
        self.disk = DiskWaiter.for_run(
            self.rd, self.log, self.seams.clock, self._interruptible_sleep, self.stop_event, job.supervise
        )

    # -- signals: handlers only set a flag; the loop acts on it at its next tick ------------

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_hup)

    def _on_stop_signal(self, signum: int, _frame: object) -> None:
        self.stop_signal = signum
        self.stop_event.set()

    def _on_hup(self, _signum: int, _frame: object) -> None:
        self.hup_seen = True  # SIGHUP reloads nothing; the runner logs it once

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> int:
        records = self._read_journal()
        state = read_state(self.rd.state)
        if self.rd.state.exists() and state is None:
            self.log.warning(Event.STATE_UNREADABLE, path=str(self.rd.state))
        self.lifted_after = lifted_after(self.rd.attempts)
        lifted = bool(records) and records[-1].attempt <= self.lifted_after
        if state is not None and state.run_state in _ENDED and not lifted:
            self.log.info(
                Event.RUN_ALREADY_ENDED,
                run_state=state.run_state.value,
                note=state.note,
                fix=ENDED_FIX,
            )
            return int(_ENDED[state.run_state])
        self.gpu = self.seams.open_gpu(self.job.resources.device)
        try:
            records = self._reclaim_in_flight(records, state)
            self.log.info(
                Event.RUN_RESUMED if records else Event.RUN_STARTED,
                output_dir=str(self.rd.root),
                attempts_so_far=len(records),
            )
            if self.gpu is None:
                self.log.info(Event.GPU_MONITOR_UNAVAILABLE, why="NVML not available: no GPU readings")
            self.settings = with_card_budget(self.settings, self.gpu)
            job = self.job
            self.first = first_plan(
                job.knobs, self.settings, job.train.target_modules, self.as_written, job.resources.device
            )
            if not records:
                announce_plan(self.log, self.first.note)
            return self._loop_outlasting_full_disks(records)
        finally:
            if self.gpu is not None:
                self.gpu.close()
            clean_staging(self.rd.root, self.rd.checkpoints)  # any verdict: no next child will

    def _reclaim_in_flight(self, records: list[AttemptRecord], state: State | None) -> list[AttemptRecord]:
        if state is not None and state.in_flight is not None:
            reclaimed = reclaim(state.in_flight, records, self.rd, self.seams, self.log)
            if reclaimed is not None:
                records.append(self._conclude(reclaimed, records, reclaimed=True))
        return records

    def _loop_outlasting_full_disks(self, records: list[AttemptRecord]) -> int:
        """The loop; when one of the supervisor's own writes finds no room, wait for room and go on.

        Going on is what a supervisor restart does: read the journal and the state again and
        reclaim the attempt in flight. The journal is fsynced before each action, so this loses
        nothing a kill at the same moment would not.
        """
        while True:
            try:
                return self._loop(records)
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                if not self.disk.outlast(exc):
                    return self.disk.verdict(self.stop_signal)
                records = self._reclaim_in_flight(self._read_journal(), read_state(self.rd.state))

    def _loop(self, records: list[AttemptRecord]) -> int:
        runner = AttemptRunner(self._runner_context())
        try:
            return self._attempts(runner, records)
        finally:
            runner.close()  # its warm spare, on every way out

    def _attempts(self, runner: AttemptRunner, records: list[AttemptRecord]) -> int:
        while True:
            plan = next_plan(records, self._plan_facts())
            if isinstance(plan, Verdict):
                # RUNNING -> SUCCEEDED | GAVE_UP | FAILED
                write_state(self.rd.state, State(plan.run_state, plan.knobs, note=plan.note))
                return int(plan.exit_code)
            if self.stop_signal is not None:
                return self._stopped(plan.knobs, plan.phase)
            number = max((r.attempt for r in records), default=0) + 1
            record = self._conclude(runner.run(number, plan), records)  # STARTING|BACKOFF -> RUNNING
            records.append(record)
            if record.outcome is Outcome.STOPPED:
                return self._stopped(plan.knobs, plan.phase)  # RUNNING -> STOPPED
            decision = record.decision
            if record.restarts and decision and decision.knobs == record.knobs and not decision.waited_s:
                self._backoff(records)  # RUNNING -> BACKOFF: only an unchanged retry waits

    def _read_journal(self) -> list[AttemptRecord]:
        records, bad = read_attempts(self.rd.attempts)
        if bad:
            self.log.warning(Event.JOURNAL_LINE_UNREADABLE, lines=bad, path=str(self.rd.attempts))
        return records

    def _plan_facts(self) -> PlanFacts:
        return PlanFacts(self.first, self.job.train.merge, self.rd.merged.exists(), self.lifted_after)

    def _runner_context(self) -> RunnerContext:
        return RunnerContext(
            job=self.job,
            rd=self.rd,
            seams=self.seams,
            log=self.log,
            display=self.display,
            gpu=self.gpu,
            stop_signal=lambda: self.stop_signal,
            hup_seen=lambda: self.hup_seen,
            gpu_budget=None if self.job.resources.device == "cpu" else self.settings.budget_bytes,
        )

    # -- after an attempt: judge, decide, journal ------------------------------------------

    def _conclude(
        self, o: AttemptOutcome, records: Sequence[AttemptRecord], reclaimed: bool = False
    ) -> AttemptRecord:
        """The one path from an ended attempt (watched or reclaimed) to its journal line."""
        log = self.log.bind(attempt=o.number)
        fit = step_fit(self.settings, self.job.resources.device, o.plan)
        verdict = judge(o, self._phase_done(o.plan.phase), fit)
        if isinstance(verdict, Failure):
            verdict = self.disk.explain(verdict)
            log.info(
                Event.FAILURE_CLASSIFIED,
                kind=verdict.kind.value,
                stage=verdict.stage.value,
                numbers=dict(verdict.numbers),
                evidence=verdict.evidence,
                message=verdict.message[:500],
                reclaimed=reclaimed,
                memory_snapshot=o.report.memory_snapshot if o.report else None,
                rank=verdict.rank,
                local_rank=verdict.local_rank,
            )
            return self._decide(o, verdict, records, log)
        next_from = None if verdict is Outcome.SUCCEEDED else self._resume_step(o.plan.knobs)
        record = self._journal(record_of(o, verdict, next_from))
        if verdict is Outcome.SUCCEEDED:
            announce_success(log, record, [*records, record], self.job.train.merge, self.rd, reclaimed)
        elif verdict is Outcome.INTERRUPTED:
            log.info(
                Event.ATTEMPT_INTERRUPTED,
                steps=record.steps_completed,
                resume_from=record.next_resume_from,
                why="the supervisor stopped while this attempt ran; its config is not counted as failed",
            )
        return record

    def _decide(
        self, o: AttemptOutcome, failure: Failure, records: Sequence[AttemptRecord], log: Any
    ) -> AttemptRecord:
        plan = o.plan
        self.settings = with_sample_lengths(self.settings, o.progress.events)
        if failure.kind is _DAMAGED and (quarantined := self._quarantine(o, failure, records, log)):
            return quarantined
        if failure.kind is FailureKind.DISK_FULL:
            failure = self.disk.with_room_needed(failure)
        this = policy.PastAttempt(plan.knobs, failure.kind, max(0, o.steps_completed - o.resumed_from))
        # A lifted verdict starts the budgets afresh: the attempts before it were judged already.
        history = [*policy_history([r for r in records if r.attempt > self.lifted_after]), this]
        decision = policy.decide(failure, plan.knobs, history, self.settings, phase=plan.phase.value)
        waited = None
        while isinstance(decision, policy.Wait):
            if decision.resource is policy.WaitFor.DISK:
                waited = self.disk.wait(decision)  # RUNNING -> WAITING (for room on the disk)
            else:
                waited = self._memory_wait(decision, failure, plan.knobs, log)  # RUNNING -> WAITING
            if waited.stopped:
                # Stopped while waiting: the run stays resumable; this is no verdict on the config.
                stopped = failure_record(failure, o.report)
                return self._journal(record_of(o, Outcome.STOPPED, self._resume_step(plan.knobs), stopped))
            decision = policy.decide(
                failure, plan.knobs, history, self.settings, waited=waited, phase=plan.phase.value
            )
        next_from = None
        if isinstance(decision, policy.Restart):
            reinit = decision.survives is Survives.ADAPTER_REINIT
            next_from = 0 if reinit else self._resume_step(decision.knobs)
        entry = DecisionRecord.of(decision, waited.waited_s if waited else 0.0)
        record = self._journal(
            record_of(o, Outcome.FAILED, next_from, failure_record(failure, o.report), entry)
        )
        announce_decision(log, record, failure, o.report, [*records, record], self.rd)
        return record

    def _quarantine(
        self, o: AttemptOutcome, failure: Failure, records: Sequence[AttemptRecord], log: Any
    ) -> AttemptRecord | None:
        """The checkpoint the child could not load is moved aside and the same knobs resume from
        the next older one (no verdict on the config); None when it cannot be moved (the policy
        then decides as for any failure)."""
        moved = quarantine_reported(o.report, self.rd.checkpoints)
        if moved is None:
            return None
        log_quarantined(log, [moved])
        entry = DecisionRecord.retry_from_older(o.plan.knobs, moved.path.name)
        next_from = self._resume_step(o.plan.knobs)
        record = self._journal(
            record_of(o, Outcome.FAILED, next_from, failure_record(failure, o.report), entry)
        )
        announce_decision(log, record, failure, o.report, [*records, record], self.rd)
        return record

    def _journal(self, record: AttemptRecord) -> AttemptRecord:
        append_attempt(self.rd.attempts, record)
        store, shape = peak_store_path(self.job), self.settings.shape
        if store and shape and record.peak and record.steps_progressed > 0 and record.phase is Phase.TRAIN:
            record_peak(store, shape, record.knobs, record.peak.bytes)  # best effort: a cache
        return record

    def _resume_step(self, knobs: Knobs) -> int:
        """The step an attempt with ``knobs`` would resume from: the same rule the spawn uses."""
        return resume_point(self.rd.checkpoints, knobs).step

    def _phase_done(self, phase: Phase) -> bool:
        return (self.rd.merged if phase is Phase.MERGE else self.rd.adapter).exists()

    # -- waiting ---------------------------------------------------------------------------

    def _backoff(self, records: Sequence[AttemptRecord]) -> None:
        failures_in_a_row = 0
        for record in reversed(records):
            if record.outcome is not Outcome.FAILED:
                break
            failures_in_a_row += 1
        supervise = self.job.supervise
        seconds = backoff_seconds(failures_in_a_row, supervise.backoff_initial, supervise.backoff_max)
        write_state(self.rd.state, State(RunState.BACKOFF, records[-1].knobs, note=f"{seconds:.1f}s"))
        self.log.info(Event.BACKOFF, seconds=round(seconds, 1), failures_in_a_row=failures_in_a_row)
        self._interruptible_sleep(seconds)

    def _memory_wait(self, wait: policy.Wait, failure: Failure, knobs: Knobs, log: Any) -> policy.WaitResult:
        write_state(self.rd.state, State(RunState.WAITING, knobs, note=wait.why))
        supervise = self.job.supervise
        pacing = (supervise.backoff_initial, supervise.backoff_max)
        return wait_for_memory(
            self.gpu, wait, failure, log, self.seams.clock, self._interruptible_sleep, self.stop_event, pacing
        )

    def _ping(self, now: float) -> None:
        # systemd's watchdog (WatchdogSec=) wants a sign of life at least every interval.
        if self._watchdog_every is not None and now - self._last_ping >= self._watchdog_every / 2:
            notify.watchdog()
            self._last_ping = now

    def _interruptible_sleep(self, seconds: float) -> None:
        deadline = self.seams.clock() + seconds
        while self.stop_signal is None and self.seams.clock() < deadline:
            self._ping(self.seams.clock())
            self.seams.sleep(min(self.seams.tick_s, max(0.0, deadline - self.seams.clock())))

    # -- stopping --------------------------------------------------------------------------

    def _stopped(self, knobs: Knobs, phase: Phase) -> int:
        signum = self.stop_signal or signal.SIGTERM
        write_state(self.rd.state, State(RunState.STOPPED, knobs, phase, note="stopped by signal"))
        self.log.info(Event.STOPPED, signal=signal.Signals(signum).name, resumable=True)
        return 128 + int(signum)


__all__ = ["Plan", "Seams", "Supervisor"]
