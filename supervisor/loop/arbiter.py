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
from qlora_supervise.supervisor.loop.announce import announce_decision, announce_success
from qlora_supervise.supervisor.loop.outcome import AttemptOutcome, failure_record, judge, record_of
from qlora_supervise.supervisor.loop.planner import Plan, PlanFacts, Verdict, next_plan
from qlora_supervise.supervisor.loop.reclaim import reclaim
from qlora_supervise.supervisor.loop.resume import resume_point
from qlora_supervise.supervisor.loop.runner import AttemptRunner, RunnerContext
from qlora_supervise.supervisor.loop.seams import Seams
from qlora_supervise.supervisor.loop.settings import with_card_budget
from qlora_supervise.supervisor.loop.waiting import backoff_seconds, wait_for_free_memory
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.history import policy_history
from qlora_supervise.supervisor.record.journal import (
    RunState,
    State,
    append_attempt,
    read_attempts,
    read_state,
    write_state,
)
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
from qlora_supervise.trainer_child.protocol import Knobs

_ENDED = {
    RunState.SUCCEEDED: SupervisorExitCode.FINISHED,
    RunState.GAVE_UP: SupervisorExitCode.GAVE_UP,
    RunState.FAILED: SupervisorExitCode.NOT_RETRYABLE,
}


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
    ) -> None:
        self.job = job
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
        if state is not None and state.run_state in _ENDED:
            self.log.info(
                Event.RUN_ALREADY_ENDED,
                run_state=state.run_state.value,
                note=state.note,
                fix="the verdict stands for this output_dir: train again with a new output_dir",
            )
            return int(_ENDED[state.run_state])
        if state is not None and state.in_flight is not None:
            reclaimed = reclaim(state.in_flight, records, self.rd, self.seams, self.log)
            if reclaimed is not None:
                records.append(self._conclude(reclaimed, records, reclaimed=True))
        self.log.info(
            Event.RUN_RESUMED if records else Event.RUN_STARTED,
            output_dir=str(self.rd.root),
            attempts_so_far=len(records),
        )
        self.gpu = self.seams.open_gpu(self.job.resources.device)
        if self.gpu is None:
            self.log.info(Event.GPU_MONITOR_UNAVAILABLE, why="NVML not available: no GPU readings")
        self.settings = with_card_budget(self.settings, self.gpu)
        try:
            return self._loop(records)
        finally:
            if self.gpu is not None:
                self.gpu.close()

    def _loop(self, records: list[AttemptRecord]) -> int:
        runner = AttemptRunner(self._runner_context())
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
        return PlanFacts(self.job.knobs, self.job.train.merge, self.rd.merged.exists())

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
            ping=self._ping,
        )

    # -- after an attempt: judge, decide, journal ------------------------------------------

    def _conclude(
        self, o: AttemptOutcome, records: Sequence[AttemptRecord], reclaimed: bool = False
    ) -> AttemptRecord:
        """The one path from an ended attempt (watched or reclaimed) to its journal line."""
        log = self.log.bind(attempt=o.number)
        verdict = judge(o, self._phase_done(o.plan.phase))
        if isinstance(verdict, Failure):
            log.info(
                Event.FAILURE_CLASSIFIED,
                kind=verdict.kind.value,
                stage=verdict.stage.value,
                numbers=dict(verdict.numbers),
                evidence=verdict.evidence,
                message=verdict.message[:500],
                reclaimed=reclaimed,
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
        this = policy.PastAttempt(plan.knobs, failure.kind, max(0, o.steps_completed - o.resumed_from))
        history = [*policy_history(records), this]
        decision = policy.decide(failure, plan.knobs, history, self.settings, phase=plan.phase.value)
        waited = None
        while isinstance(decision, policy.Wait):
            waited = self._wait_for_memory(decision, failure, plan.knobs, log)  # RUNNING -> WAITING
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

    def _journal(self, record: AttemptRecord) -> AttemptRecord:
        append_attempt(self.rd.attempts, record)
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

    def _wait_for_memory(
        self, wait: policy.Wait, failure: Failure, knobs: Knobs, log: Any
    ) -> policy.WaitResult:
        """Carry out the policy's Wait: poll NVML until the memory is back, the timeout, or a stop."""
        write_state(self.rd.state, State(RunState.WAITING, knobs, note=wait.why))
        log.info(
            Event.WAITING_FOR_MEMORY,
            why=wait.why,
            needed_bytes=wait.needed_bytes,
            timeout_s=wait.seconds,
            numbers=dict(failure.numbers),
        )
        started = self.seams.clock()
        supervise = self.job.supervise
        free = wait_for_free_memory(
            self._gpu_free,
            wait.needed_bytes,
            wait.seconds,
            supervise.backoff_initial,
            supervise.backoff_max,
            sleep=self._interruptible_sleep,
            stop_requested=self.stop_event,
        )
        waited = self.seams.clock() - started
        if free is None:
            event = Event.NO_MEMORY_READING
        else:
            event = Event.MEMORY_AVAILABLE if free >= wait.needed_bytes else Event.MEMORY_WAIT_TIMED_OUT
        log.info(event, free_bytes=free, waited_s=round(waited, 1))
        return policy.WaitResult(free, waited, stopped=self.stop_signal is not None)

    def _gpu_free(self) -> int | None:
        sample = self.gpu.sample(set()) if self.gpu is not None else None
        return sample.free if sample else None

    # -- stopping --------------------------------------------------------------------------

    def _stopped(self, knobs: Knobs, phase: Phase) -> int:
        signum = self.stop_signal or signal.SIGTERM
        write_state(self.rd.state, State(RunState.STOPPED, knobs, phase, note="stopped by signal"))
        self.log.info(Event.STOPPED, signal=signal.Signals(signum).name, resumable=True)
        return 128 + int(signum)


__all__ = ["Plan", "Seams", "Supervisor"]
