"""The arbiter: runs one job's run directory to a verdict, one attempt at a time. Signal handlers
only set a flag; one loop moves the run's state (``record.journal.RunState`` draws the machine).
Crash safety: every decision is appended to ``attempts.jsonl`` (fsynced) before it is acted on,
and ``state.json`` names the attempt in flight; started again after a kill, the arbiter reclaims
that attempt and goes on from the journal, so a config that failed never runs again the same way."""

from __future__ import annotations

import contextlib
import signal
import sys
from typing import TextIO

from structlog.typing import FilteringBoundLogger

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.choice import Trial
from qlora_supervise.supervisor.exit_codes import SupervisorExitCode
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.loop import planner, waiting
from qlora_supervise.supervisor.loop.child import Seams
from qlora_supervise.supervisor.loop.child_output import reclaim
from qlora_supervise.supervisor.loop.climb_back import ClimbBack
from qlora_supervise.supervisor.loop.conclude import Conclusions, Pending, Turn
from qlora_supervise.supervisor.loop.outcome import AttemptOutcome
from qlora_supervise.supervisor.loop.resume import clean_staging
from qlora_supervise.supervisor.loop.runner import AttemptRunner, RunnerContext
from qlora_supervise.supervisor.loop.settings import with_card_budget
from qlora_supervise.supervisor.loop.waiting import DiskWaiter, Pacer
from qlora_supervise.supervisor.record import journal
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.journal import AttemptRecord, Phase, RunState, State, write_state
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.reporting.console import ProgressDisplay
from qlora_supervise.supervisor.reporting.outputs import Reporter
from qlora_supervise.supervisor.watching.gpu import GpuProbe
from qlora_supervise.trainer_child.contract.disk_space import is_disk_full
from qlora_supervise.trainer_child.contract.spec import Knobs

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
FINISHED_FIX = (
    "the run finished and its adapter is kept: to train further, raise train.max_steps (or epochs) "
    "in the job and run it again (it continues from the last checkpoint); to train anew in the same "
    "output_dir, `run --restart` (a new generation)"
)


class Supervisor:
    """Runs one job's run directory to a verdict. ``run()`` returns the process exit code."""

    def __init__(
        self,
        job: Job,
        run_dir: RunDir,
        log: FilteringBoundLogger,
        seams: Seams | None = None,
        console: TextIO = sys.stderr,
        plain: bool = False,
        settings: policy.Settings | None = None,
        reporter: Reporter | None = None,
        as_written: bool = False,
    ) -> None:
        self.job, self.rd, self.log, self.as_written = job, run_dir, log, as_written
        self.seams = seams = seams or Seams()
        self.display = reporter or Reporter(ProgressDisplay(console, plain))
        self.stop_signal: int | None = None
        self.hup_seen = False
        self.gpu: GpuProbe | None = None
        self.pacer = Pacer(seams.clock, seams.sleep, seams.tick_s, lambda: self.stop_signal is not None)
        self.pacing = (job.supervise.backoff_initial, job.supervise.backoff_max)  # between two polls
        self.disk = DiskWaiter(run_dir, log, self.pacer, job.supervise.disk_wait, self.pacing)
        self.book = Conclusions(job, run_dir, log, self.disk, settings or policy.Settings())

    @property
    def settings(self) -> policy.Settings:
        """The policy's settings as the run has updated them (the card's budget, peaks, speeds)."""
        return self.book.settings

    def install_signal_handlers(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_signal)

    def _on_signal(self, signum: int, _frame: object) -> None:
        if signum == signal.SIGHUP:
            self.hup_seen = True  # SIGHUP reloads nothing; the runner logs it once
        else:
            self.stop_signal = signum

    def run(self) -> int:
        records = self.book.records = self._read_journal()
        state = journal.read_state(self.rd.state)
        if self.rd.state.exists() and state is None:
            self.log.warning(Event.STATE_UNREADABLE, path=str(self.rd.state))
        self.book.lifted_after = journal.lifted_after(self.rd.attempts)
        lifted = bool(records) and records[-1].attempt <= self.book.lifted_after
        if state is not None and state.run_state in _ENDED and not lifted:
            fix = FINISHED_FIX if state.run_state is RunState.SUCCEEDED else ENDED_FIX
            self.log.info(Event.RUN_ALREADY_ENDED, run_state=state.run_state.value, note=state.note, fix=fix)
            return int(_ENDED[state.run_state])
        self.gpu = self.seams.open_gpu(self.job.resources.device)
        try:
            turn = self._reclaim_in_flight(state)
            started = Event.RUN_RESUMED if records else Event.RUN_STARTED
            self.log.info(started, output_dir=str(self.rd.root), attempts_so_far=len(records))
            if self.gpu is None:
                self.log.info(Event.GPU_MONITOR_UNAVAILABLE, why="NVML not available: no GPU readings")
            self.book.settings = with_card_budget(self.settings, self.gpu)
            job = self.job
            self.first = planner.first_plan(
                job.knobs, self.settings, job.train.target_modules, self.as_written, job.resources.device
            )
            if not records:
                planner.announce_plan(self.log, self.first.note)
                if self.first.nothing_fits:  # no verdict in state.json: a rerun plans again
                    why = f"nothing fits: {self.first.nothing_fits}; no child was started"
                    self.log.error(Event.NOTHING_FITS, why=why)
                    return int(SupervisorExitCode.NOTHING_FITS)
            return self._loop_outlasting_full_disks(turn)
        finally:
            if self.gpu is not None:
                self.gpu.close()
            clean_staging(self.rd.root, self.rd.checkpoints)  # any verdict: no next child will

    def _reclaim_in_flight(self, state: State | None) -> Turn:
        """The attempt a dead supervisor left in flight, judged like a watched one."""
        if state is not None and state.in_flight is not None:
            reclaimed = reclaim(state.in_flight, self.book.records, self.rd, self.seams, self.log)
            if reclaimed is not None:
                return self.book.conclude(reclaimed, reclaimed=True)
        return Turn(RunState.STARTING)

    def _loop_outlasting_full_disks(self, turn: Turn) -> int:
        """The loop; when the supervisor's own write finds no room, wait for room and go on as a restart."""
        while True:
            try:  # the runner closes (its warm spare goes) on every way out, before any wait for room
                with contextlib.closing(AttemptRunner(self._runner_context())) as runner:
                    return self._machine(runner, turn)
            except OSError as exc:
                if not is_disk_full(exc):
                    raise
                if not self.disk.outlast(exc):
                    return self.disk.verdict(self.stop_signal)
                self.book.records = self._read_journal()
                turn = self._reclaim_in_flight(journal.read_state(self.rd.state))

    def _machine(self, runner: AttemptRunner, turn: Turn) -> int:
        """The state machine: one ``if/elif`` over the state; each branch says where it goes next."""
        records = self.book.records
        while True:
            state = turn.state
            if state is RunState.STARTING:
                merged, lifted = self.rd.merged.exists(), self.book.lifted_after
                facts = planner.PlanFacts(self.first, self.job.train.merge, merged, lifted, self.settings)
                plan = planner.next_plan(records, facts)
                if isinstance(plan, planner.Verdict):
                    # STARTING -> SUCCEEDED | GAVE_UP | FAILED
                    self._move(State(plan.run_state, plan.knobs, note=plan.note))
                    return int(plan.exit_code)
                if self.stop_signal is not None:
                    return self._stopped(plan.knobs, plan.phase)  # STARTING -> STOPPED
                turn = Turn(RunState.RUNNING, plan=plan)  # STARTING -> RUNNING
            elif state is RunState.RUNNING and turn.plan is not None:
                turn = self.book.conclude(self._run_attempt(runner, turn.plan))
            elif state is RunState.WAITING and turn.pending is not None:
                turn = self.book.after_wait(turn.pending, self._wait(turn.pending))
            elif state is RunState.BACKOFF:
                turn = self._backoff()
            elif state is RunState.STOPPED:
                return self._stopped(records[-1].knobs, records[-1].phase)
            else:
                raise AssertionError(f"{state.value} without its plan (RUNNING) or decision (WAITING)")

    def _run_attempt(self, runner: AttemptRunner, plan: planner.Plan) -> AttemptOutcome:
        """The RUNNING state: one attempt from its spec to its end."""
        ready = runner.prepare(max((r.attempt for r in self.book.records), default=0) + 1, plan)
        # In flight before the spawn (pid unknown) and after it: a kill in between leaves the attempt named.
        self._move(State(RunState.RUNNING, plan.knobs, plan.phase, ready.in_flight()))
        proc = runner.spawn(ready)
        self._move(State(RunState.RUNNING, plan.knobs, plan.phase, ready.in_flight(proc.pid)))
        return runner.run(ready, proc)

    def _wait(self, pending: Pending) -> policy.WaitResult:
        """WAITING: carry out the policy's Wait (for GPU memory, or room on the disk)."""
        wait = pending.decision
        assert isinstance(wait, policy.Wait), "only a Wait leads to WAITING"
        if wait.resource is policy.WaitFor.DISK:
            return self.disk.wait(wait)  # state.json unwritten: on a full disk it could not be
        self._move(State(RunState.WAITING, pending.outcome.plan.knobs, note=wait.why))
        log = self.log.bind(attempt=pending.outcome.number)
        return waiting.wait_for_memory(self.gpu, wait, pending.failure, log, self.pacer, self.pacing)

    def _backoff(self) -> Turn:
        """BACKOFF: the pause before an unchanged retry, longer for each failure in a row."""
        failures = waiting.failures_in_a_row(self.book.records)
        seconds = waiting.backoff_s(failures, *self.pacing)
        self._move(State(RunState.BACKOFF, self.book.records[-1].knobs, note=f"{seconds:.1f}s"))
        self.log.info(Event.BACKOFF, seconds=round(seconds, 1), failures_in_a_row=failures)
        self.pacer.pause(seconds)
        return Turn(RunState.STARTING)  # BACKOFF -> STARTING (a stop is seen there)

    def _move(self, state: State) -> None:
        """The one writer of ``state.json``: the state the loop has just moved to."""
        write_state(self.rd.state, state)

    def _stopped(self, knobs: Knobs, phase: Phase) -> int:
        signum = self.stop_signal or signal.SIGTERM
        self._move(State(RunState.STOPPED, knobs, phase, note="stopped by signal"))
        self.log.info(Event.STOPPED, signal=signal.Signals(signum).name, resumable=True)
        return 128 + int(signum)

    def _read_journal(self) -> list[AttemptRecord]:
        records, bad = journal.read_attempts(self.rd.attempts)
        if bad:
            self.log.warning(Event.JOURNAL_LINE_UNREADABLE, lines=bad, path=str(self.rd.attempts))
        return records

    def _runner_context(self) -> RunnerContext:
        first = self.first
        trial = Trial(first.knobs, first.speed_trial, first.speed_trial_limit) if first.speed_trial else None
        climb = ClimbBack(self.book.records, lambda: self.settings, trial, self.log)
        budget = None if self.job.resources.device == "cpu" else self.settings.budget_bytes
        stop, hup = lambda: self.stop_signal, lambda: self.hup_seen
        return RunnerContext(
            self.job, self.rd, self.seams, self.log, self.display, self.gpu, stop, hup, budget, climb
        )


__all__ = ["Seams", "Supervisor"]
