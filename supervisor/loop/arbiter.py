"""The main loop: spawn an attempt, watch it, classify its end, carry out the policy's decision.

Single-threaded and boring (gunicorn's arbiter, torchelastic's agent): signal handlers only
set a flag; each tick polls the child, reads heartbeats, samples memory, checks for a hang.
Side effects go through :class:`Seams` so tests can run the loop fast with scripted children.

Crash safety. Everything the loop decides is appended to ``attempts.jsonl`` (fsynced) before
it acts, and ``state.json`` names the attempt in flight. Started again after a kill at any
moment, the loop finishes or reclaims the in-flight attempt and continues from the journal's
last decision, so a config that failed is never run again the same way.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.rungs import Survives
from qlora_supervise.supervisor.diagnosis.classify import classify_exit
from qlora_supervise.supervisor.diagnosis.failure import ChildExit, Failure
from qlora_supervise.supervisor.exit_codes import SupervisorExitCode
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.loop import child as child_mod
from qlora_supervise.supervisor.loop.resume import ResumePoint, resume_point
from qlora_supervise.supervisor.loop.waiting import backoff_seconds, bytes_needed, wait_for_free_memory
from qlora_supervise.supervisor.record.history import decision_entry, failure_entry, policy_history, story
from qlora_supervise.supervisor.record.journal import (
    AttemptFacts,
    AttemptRecord,
    InFlight,
    RunState,
    State,
    append_attempt,
    knobs_from_record,
    read_attempts,
    read_state,
    write_state,
)
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.reporting import notify
from qlora_supervise.supervisor.reporting.console import ProgressDisplay
from qlora_supervise.supervisor.watching.cgroup import oom_kill_count
from qlora_supervise.supervisor.watching.gpu import GpuMonitor
from qlora_supervise.supervisor.watching.heartbeats import HeartbeatReader
from qlora_supervise.supervisor.watching.watch import Watched, hung, sample_memory
from qlora_supervise.trainer_child.durable import write_text_atomic
from qlora_supervise.trainer_child.processes import pid_alive
from qlora_supervise.trainer_child.protocol import AttemptSpec, ErrorReport, ExitCode, Knobs, Stage


@dataclass
class Seams:
    """The loop's side effects, replaceable in tests."""

    clock: Callable[[], float] = time.monotonic
    wall: Callable[[], float] = time.time
    sleep: Callable[[float], None] = time.sleep
    spawn: Callable[..., child_mod.ChildProcess] = child_mod.spawn_child
    argv: Callable[[Path, str], list[str]] = child_mod.child_argv
    open_gpu: Callable[[str], GpuMonitor | None] = GpuMonitor.open
    oom_kills: Callable[[], int | None] = oom_kill_count
    tick_s: float = 0.5
    sample_every_s: float = 2.0
    stop_grace_s: float = 180.0


@dataclass(frozen=True)
class Plan:
    """What the next attempt runs."""

    phase: str
    knobs: Knobs
    fresh_start: bool = False


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
    ) -> None:
        self.job = job
        self.settings = settings or policy.Settings()
        self.rd = run_dir
        self.log = log
        self.seams = seams or Seams()
        self.display = ProgressDisplay(console, plain)
        self.stop_signal: int | None = None
        self.hup_seen = False
        self._watchdog_every = notify.watchdog_interval_s()
        self._last_ping = -1e18
        self.gpu: GpuMonitor | None = None

    # -- signals ---------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, self._on_stop_signal)
        signal.signal(signal.SIGINT, self._on_stop_signal)
        signal.signal(signal.SIGHUP, self._on_hup)

    def _on_stop_signal(self, signum: int, _frame: object) -> None:
        self.stop_signal = signum  # only a flag: the loop acts on it at its next tick

    def _on_hup(self, _signum: int, _frame: object) -> None:
        self.hup_seen = True  # SIGHUP reloads nothing; the loop logs it once

    # -- the run ---------------------------------------------------------------------------

    def run(self) -> int:
        records = self._read_journal()
        state = read_state(self.rd.state)
        if self.rd.state.exists() and state is None:
            self.log.warning("state_unreadable", path=str(self.rd.state))
        finished = self._already_finished(state, records)
        if finished is not None:
            return finished
        if state is not None and state.in_flight is not None:
            records = self._reclaim(state.in_flight, records)
        self.log.info(
            "run_resumed" if records else "run_started",
            output_dir=str(self.rd.root),
            attempts_so_far=len(records),
        )
        self.gpu = self.seams.open_gpu(self.job.device)
        if self.gpu is None:
            self.log.info("gpu_monitor_unavailable", why="NVML not available: no GPU readings")
        try:
            return self._loop(records)
        finally:
            if self.gpu is not None:
                self.gpu.close()

    def _loop(self, records: list[AttemptRecord]) -> int:
        while True:
            plan = self._plan(records)
            if isinstance(plan, int):
                return plan
            if self.stop_signal is not None:
                return self._stopped(plan.knobs, plan.phase, None)
            number = max((r.attempt for r in records), default=0) + 1
            record = self._attempt(number, plan, records)
            records.append(record)
            if record.outcome == "stopped":
                return self._stopped(plan.knobs, plan.phase, None)
            if record.outcome == "failed" and record.decision and record.decision["action"] == "restart":
                self._backoff(records)

    def _read_journal(self) -> list[AttemptRecord]:
        records, bad = read_attempts(self.rd.attempts)
        if bad:
            self.log.warning("journal_line_unreadable", lines=bad, path=str(self.rd.attempts))
        return records

    def _already_finished(self, state: State | None, records: list[AttemptRecord]) -> int | None:
        if state is None:
            return None
        verdicts = {
            RunState.SUCCEEDED: SupervisorExitCode.FINISHED,
            RunState.GAVE_UP: SupervisorExitCode.GAVE_UP,
            RunState.FAILED: SupervisorExitCode.NOT_RETRYABLE,
        }
        code = verdicts.get(state.run_state)
        if code is None:
            return None
        self.log.info(
            "run_already_ended",
            run_state=state.run_state.value,
            note=state.note,
            fix="the verdict stands for this output_dir: train again with a new output_dir",
        )
        return int(code)

    # -- planning --------------------------------------------------------------------------

    def _plan(self, records: Sequence[AttemptRecord]) -> Plan | int:
        """The next attempt from the journal's last decision (or the job's first config)."""
        if not records:
            return Plan("train", self.job.first_knobs())
        last = records[-1]
        knobs = knobs_from_record(last)
        if last.outcome in ("stopped", "interrupted"):
            return Plan(last.phase, knobs)
        if last.outcome == "succeeded":
            return self._after_success(last)
        decision = last.decision or {}
        action = decision.get("action")
        if action == "restart":
            survives = Survives(decision.get("survives", "all"))
            return Plan(
                last.phase,
                Knobs(**decision["knobs"]),
                fresh_start=survives is Survives.ADAPTER_REINIT,
            )
        return self._verdict(decision, knobs)

    def _after_success(self, last: AttemptRecord) -> Plan | int:
        if last.phase == "train" and self.job.train_spec().merge and not self.rd.merged.exists():
            return Plan("merge", knobs_from_record(last))
        write_state(self.rd.state, State(RunState.SUCCEEDED, knobs_from_record(last), note="finished"))
        return int(SupervisorExitCode.FINISHED)

    def _verdict(self, decision: Mapping[str, Any], knobs: Knobs) -> int:
        retryable = decision.get("retryable", True)
        run_state = RunState.GAVE_UP if retryable else RunState.FAILED
        write_state(self.rd.state, State(run_state, knobs, note=str(decision.get("why", ""))))
        return int(SupervisorExitCode.GAVE_UP if retryable else SupervisorExitCode.NOT_RETRYABLE)

    # -- one attempt -----------------------------------------------------------------------

    def _attempt(self, number: int, plan: Plan, records: Sequence[AttemptRecord]) -> AttemptRecord:
        resume = self._prepare_checkpoints(number, plan)
        resumed_from = resume.step
        spec = self._write_spec(number, plan, resume)
        started_at = self.seams.wall()
        argv = self.seams.argv(self.rd.attempt_dir(number) / "spec.json", plan.phase)
        env = child_mod.child_env(self._base_env(), plan.knobs)
        oom_kills_before = self.seams.oom_kills()
        # In flight before the spawn (pid unknown) and again after it: a supervisor killed in
        # between leaves a state that names the attempt, so its child can be found and stopped.
        flight = InFlight(number, plan.phase, plan.knobs, resumed_from, None, started_at)
        write_state(self.rd.state, State(RunState.RUNNING, plan.knobs, plan.phase, flight))
        proc = self.seams.spawn(argv, env, self.rd.attempt_dir(number) / "child.log", self.rd.root)
        notify.status(f"attempt {number} ({plan.phase}) running, pid {proc.pid}")
        flight = dataclasses.replace(flight, pid=proc.pid)
        write_state(self.rd.state, State(RunState.RUNNING, plan.knobs, plan.phase, flight))
        self.log.info(
            "attempt_started",
            attempt=number,
            phase=plan.phase,
            pid=proc.pid,
            resumed_from=resumed_from,
            reset_optimizer=spec.reset_optimizer,
            knobs=dataclasses.asdict(plan.knobs),
            effective_batch=plan.knobs.effective_batch,
        )
        watched = self._watch(number, proc, spec)
        code = proc.poll() if not (watched.hang or watched.stopped_by_signal) else None
        if code is None:
            code = proc.stop(self.seams.stop_grace_s, self.seams.sleep)
        exit_ = ChildExit(
            returncode=code if code >= 0 else None,
            signal=-code if code < 0 else None,
            killed_by_supervisor="hang" if watched.hang else ("stop" if watched.stopped_by_signal else None),
            duration_s=self.seams.clock() - proc.started_monotonic,
        )
        self.display.clear()
        self.log.info(
            "child_exited",
            attempt=number,
            exit_code=exit_.returncode,
            signal=exit_.signal,
            killed_by_supervisor=exit_.killed_by_supervisor,
            duration_s=round(exit_.duration_s, 1),
            step=watched.progress.step,
        )
        kills_after = self.seams.oom_kills()
        oom_kill_delta = (kills_after or 0) - (oom_kills_before or 0)
        return self._conclude(number, plan, records, exit_, watched, resumed_from, started_at, oom_kill_delta)

    def _base_env(self) -> dict[str, str]:
        return dict(os.environ)

    def _prepare_checkpoints(self, number: int, plan: Plan) -> ResumePoint:
        """Resume point of the next attempt: the newest complete checkpoint its knobs can load."""
        if plan.phase == "merge":
            return ResumePoint(0, None, False)
        if plan.fresh_start and self.rd.checkpoints.exists():
            # Old checkpoints hold an adapter of another shape: keep them for the user, out of the way.
            target = self.rd.superseded_checkpoints(number)
            if target.exists():
                target = target.with_name(f"{target.name}.{int(self.seams.wall())}")
            self.rd.checkpoints.rename(target)
            self.log.info("checkpoints_superseded", attempt=number, moved_to=str(target))
        point = resume_point(self.rd.checkpoints, plan.knobs)
        if point.skipped:
            self.log.info("checkpoints_skipped", attempt=number, skipped=list(point.skipped))
        return point

    def _write_spec(self, number: int, plan: Plan, resume: ResumePoint) -> AttemptSpec:
        directory = self.rd.attempt_dir(number)
        if directory.exists():
            # Left by an attempt the journal never recorded (the supervisor died between spawn and
            # state.json): its error report must not be read as this attempt's.
            aside = directory.with_name(f"{directory.name}.unrecorded-{int(self.seams.wall())}")
            directory.rename(aside)
            self.log.warning("unrecorded_attempt_moved", attempt=number, moved_to=str(aside))
        spec = AttemptSpec(
            attempt=number,
            run_dir=str(self.rd.root),
            knobs=plan.knobs,
            data=self.job.data_spec(),
            train=self.job.train_spec(),
            events_file=str(directory / "child-events.jsonl"),
            error_file=str(directory / "error.json"),
            checkpoints_dir=str(self.rd.checkpoints),
            adapter_dir=str(self.rd.adapter),
            merged_dir=str(self.rd.merged),
            device=self.job.device,
            gpu_memory_limit=self.job.gpu_memory_limit_bytes,
            cpu_memory_limit=self.job.cpu_memory_limit_bytes,
            resume_from=str(resume.path) if resume.path else None,
            # The checkpoint itself says whether its optimizer state fits these knobs.
            reset_optimizer=resume.reset_optimizer,
        )
        write_text_atomic(directory / "spec.json", spec.to_json())
        return spec

    # -- watching --------------------------------------------------------------------------

    def _watch(self, number: int, proc: child_mod.ChildProcess, spec: AttemptSpec) -> Watched:
        reader = HeartbeatReader(Path(spec.events_file))
        if spec.train.max_steps > 0:
            reader.progress.max_steps = spec.train.max_steps
        watched = Watched(reader.progress)
        started = self.seams.clock()
        next_sample = started
        gpu_log = self.rd.attempt_dir(number) / "gpu.jsonl"
        hup_logged = False
        while proc.poll() is None:
            now = self.seams.clock()
            self._ping(now)
            reader.poll(now)
            self.display.update(number, reader.progress, now)
            if now >= next_sample:
                sample_memory(proc.pid, watched, self.gpu, gpu_log)
                next_sample = now + self.seams.sample_every_s
            if self.hup_seen and not hup_logged:
                self.log.info("sighup_ignored", why="the job is read once at start; restart to change it")
                hup_logged = True
            if self.stop_signal is not None:
                self._request_stop(number, proc, watched)
                return watched
            if hung(reader.progress, started, now, self.job.hang_timeout_s):
                self.log.warning(
                    "hang_detected",
                    attempt=number,
                    step=reader.progress.step,
                    stage=reader.progress.stage,
                    hang_timeout_s=self.job.hang_timeout_s,
                )
                watched.hang = True
                return watched
            self.seams.sleep(self.seams.tick_s)
        reader.poll(self.seams.clock())
        return watched

    def _request_stop(self, number: int, proc: child_mod.ChildProcess, watched: Watched) -> None:
        assert self.stop_signal is not None
        watched.stopped_by_signal = self.stop_signal
        self.display.clear()
        self.log.info(
            "stop_requested",
            attempt=number,
            signal=signal.Signals(self.stop_signal).name,
            grace_s=self.seams.stop_grace_s,
            why="the child checkpoints and exits; run the same command again to resume",
        )

    # -- after the exit --------------------------------------------------------------------

    def _conclude(
        self,
        number: int,
        plan: Plan,
        records: Sequence[AttemptRecord],
        exit_: ChildExit,
        watched: Watched,
        resumed_from: int,
        started_at: float,
        oom_kill_delta: int,
    ) -> AttemptRecord:
        report = self._read_report(number)
        steps = max(watched.progress.step, report.step if report else 0, resumed_from)
        facts = AttemptFacts(
            attempt=number,
            phase=plan.phase,
            knobs=dataclasses.asdict(plan.knobs),
            started_at=started_at,
            ended_at=self.seams.wall(),
            exit_code=exit_.returncode,
            signal=exit_.signal,
            resumed_from=resumed_from,
            steps_completed=steps,
            peak_memory={
                "child_peak": _child_peak(watched.progress.peak_bytes, report),
                "gpu_process": watched.gpu_peak_process,
                "rss": watched.rss_peak,
            },
        )
        # A child stopped for a hang also exits STOPPED (it checkpoints on SIGTERM): that is a hang.
        stopped_by_us = exit_.killed_by_supervisor == "stop"
        stopped = exit_.killed_by_supervisor is None and exit_.returncode == ExitCode.STOPPED
        if (stopped_by_us and not _failed_report(report)) or stopped:
            return self._journal(AttemptRecord.from_facts(facts, "stopped", self._resume_step(plan.knobs)))
        if exit_.returncode == 0 and self._phase_done(plan.phase):
            record = self._journal(AttemptRecord.from_facts(facts, "succeeded", None))
            self.log.info("attempt_succeeded", attempt=number, phase=plan.phase, steps=steps)
            if plan.phase == "merge" or not self.job.train_spec().merge:
                self.log.info(
                    "run_succeeded",
                    attempts=number,
                    steps=steps,
                    adapter=str(self.rd.adapter),
                    merged=str(self.rd.merged) if plan.phase == "merge" else None,
                    story=story([*records, record]),
                )
            return record
        failure = classify_exit(
            exit_,
            report,
            child_mod.log_tail(self.rd.attempt_dir(number) / "child.log"),
            cgroup_oom_kills=oom_kill_delta,
            gpu_others_bytes=watched.gpu_others_at_end,
            gpu_total_bytes=watched.gpu_total,
        )
        self.log.info(
            "failure_classified",
            attempt=number,
            kind=failure.kind.value,
            stage=failure.stage.value,
            numbers=dict(failure.numbers),
            evidence=failure.evidence,
            message=failure.message[:500],
        )
        return self._decide_and_record(facts, plan, records, failure, report)

    def _journal(self, record: AttemptRecord) -> AttemptRecord:
        append_attempt(self.rd.attempts, record)
        return record

    def _resume_step(self, knobs: Knobs) -> int:
        """The step an attempt with ``knobs`` would resume from: the same rule the spawn uses."""
        return resume_point(self.rd.checkpoints, knobs).step

    def _phase_done(self, phase: str) -> bool:
        return (self.rd.merged if phase == "merge" else self.rd.adapter).exists()

    def _read_report(self, number: int) -> ErrorReport | None:
        path = self.rd.attempt_dir(number) / "error.json"
        if not path.exists():
            return None
        try:
            return ErrorReport.from_json(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, TypeError) as exc:
            self.log.warning("report_unreadable", path=str(path), error=str(exc))
            return None

    def _decide_and_record(
        self,
        facts: AttemptFacts,
        plan: Plan,
        records: Sequence[AttemptRecord],
        failure: Failure,
        report: ErrorReport | None,
    ) -> AttemptRecord:
        history = [
            *policy_history(records),
            policy.PastAttempt(plan.knobs, failure.kind, facts.steps_progressed),
        ]
        decision = policy.decide(failure, plan.knobs, history, self.settings, phase=plan.phase)
        waited = 0.0
        if isinstance(decision, policy.Wait):
            free, waited = self._wait_for_memory(facts.attempt, decision, failure)
            if self.stop_signal is not None:
                # Stopped while waiting: the run stays resumable; this is no verdict on the config.
                entry = failure_entry(failure, report)
                return self._journal(
                    AttemptRecord.from_facts(facts, "stopped", self._resume_step(plan.knobs), entry)
                )
            if free is None or free >= bytes_needed(failure.numbers):
                why = (
                    "the other processes released the memory"
                    if free is not None
                    else "no NVML reading to wait on: retry the same config after the backoff"
                )
                decision = policy.Restart(plan.knobs, "wait_for_memory", {}, why, Survives.ALL)
            else:
                decision = policy.decide(
                    failure, plan.knobs, history, self.settings, contention_timed_out=True, phase=plan.phase
                )
        record = self._journal(
            AttemptRecord.from_facts(
                facts,
                "failed",
                self._next_resume(decision),
                failure=failure_entry(failure, report),
                decision={**decision_entry(decision), "waited_s": round(waited, 1)},
            )
        )
        self._log_decision(record, decision, failure, report, records)
        return record

    def _next_resume(self, decision: policy.Decision) -> int | None:
        if not isinstance(decision, policy.Restart):
            return None
        if decision.survives is Survives.ADAPTER_REINIT:
            return 0
        return self._resume_step(decision.knobs)

    def _log_decision(
        self,
        record: AttemptRecord,
        decision: policy.Decision,
        failure: Failure,
        report: ErrorReport | None,
        records: Sequence[AttemptRecord],
    ) -> None:
        if isinstance(decision, policy.Restart):
            self.log.info(
                "retry",
                attempt=record.attempt,
                failed=failure.kind.value,
                stage=failure.stage.value,
                numbers=dict(failure.numbers),
                rung=decision.rung,
                changes={k: list(v) for k, v in decision.changes.items()},
                why=decision.why,
                progress_survives=decision.survives.value,
                steps_completed=record.steps_completed,
                resume_from=record.next_resume_from,
                lost_steps=record.lost_steps,
                emergency_checkpoint=bool(report and report.emergency_checkpoint),
                effective_batch=decision.knobs.effective_batch,
            )
        elif isinstance(decision, policy.GiveUp):
            self.log.error(
                "gave_up",
                attempt=record.attempt,
                failed=failure.kind.value,
                stage=failure.stage.value,
                why=decision.why,
                retryable=decision.retryable,
                message=failure.message[:500],
                journal=str(self.rd.attempts),
                story=story([*records, record]),
            )

    # -- waiting ---------------------------------------------------------------------------

    def _backoff(self, records: Sequence[AttemptRecord]) -> None:
        failures_in_a_row = 0
        for record in reversed(records):
            if record.outcome != "failed":
                break
            failures_in_a_row += 1
        seconds = backoff_seconds(failures_in_a_row, self.job.backoff_initial_s, self.job.backoff_max_s)
        write_state(
            self.rd.state, State(RunState.BACKOFF, knobs_from_record(records[-1]), note=f"{seconds:.1f}s")
        )
        self.log.info("backoff", seconds=round(seconds, 1), failures_in_a_row=failures_in_a_row)
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
        self, number: int, decision: policy.Wait, failure: Failure
    ) -> tuple[int | None, float]:
        """Poll NVML with backoff until the memory is back, the wait times out, or a stop.

        Returns the last free-memory reading (None: NVML gave none) and the seconds waited.
        """
        needed = bytes_needed(failure.numbers)
        self.log.info(
            "waiting_for_memory",
            attempt=number,
            why=decision.why,
            needed_bytes=needed,
            timeout_s=decision.seconds,
            numbers=dict(failure.numbers),
        )
        started = self.seams.clock()
        free = wait_for_free_memory(
            self._gpu_free,
            needed,
            decision.seconds,
            self.job.backoff_initial_s,
            self.job.backoff_max_s,
            sleep=self._interruptible_sleep,
            stop_asked=lambda: self.stop_signal is not None,
        )
        waited = self.seams.clock() - started
        back = free is not None and free >= needed
        event = (
            "memory_available" if back else ("no_memory_reading" if free is None else "memory_wait_timed_out")
        )
        self.log.info(event, free_bytes=free, waited_s=round(waited, 1))
        return free, waited

    def _gpu_free(self) -> int | None:
        if self.gpu is None:
            return None
        sample = self.gpu.sample(set())
        return sample.free if sample else None

    # -- stopping and reclaiming -----------------------------------------------------------

    def _stopped(self, knobs: Knobs, phase: str, note: str | None) -> int:
        signum = self.stop_signal or signal.SIGTERM
        write_state(self.rd.state, State(RunState.STOPPED, knobs, phase, note=note or "stopped by signal"))
        self.log.info("stopped", signal=signal.Signals(signum).name, resumable=True)
        return 128 + int(signum)

    def _reclaim(self, flight: InFlight, records: list[AttemptRecord]) -> list[AttemptRecord]:
        """Finish the bookkeeping of an attempt that was running when the supervisor died."""
        if any(r.attempt == flight.number for r in records):
            return records  # its record was written; only state.json was stale
        spec_path = self.rd.attempt_dir(flight.number) / "spec.json"
        # PDEATHSIG normally ended the child already; the cmdline check keeps a reused pid safe,
        # and finds the child when the supervisor died before it could record the pid.
        pids = [flight.pid] if flight.pid else child_mod.pids_running(str(spec_path))
        for pid in pids:
            if str(spec_path) in child_mod.process_cmdline(pid) and pid_alive(pid):
                self.log.warning("orphan_child_stopping", attempt=flight.number, pid=pid)
                child_mod.stop_orphan(pid, self.seams.stop_grace_s, self.seams.clock, self.seams.sleep)
        report = self._read_report(flight.number)
        reader = HeartbeatReader(self.rd.attempt_dir(flight.number) / "child-events.jsonl")
        reader.poll(self.seams.clock())
        steps = max(reader.progress.step, report.step if report else 0, flight.resumed_from)
        facts = AttemptFacts(
            attempt=flight.number,
            phase=flight.phase,
            knobs=dataclasses.asdict(flight.knobs),
            started_at=flight.started_at,
            ended_at=self.seams.wall(),
            exit_code=report.exit_code if report else None,
            signal=None,
            resumed_from=flight.resumed_from,
            steps_completed=steps,
            peak_memory={"child_peak": reader.progress.peak_bytes},
        )
        plan = Plan(flight.phase, flight.knobs)
        if report is not None and report.exit_code not in (ExitCode.OK, ExitCode.STOPPED):
            # The child failed while nobody watched: classify it as if we had seen it exit.
            exit_ = ChildExit(report.exit_code, None, None, 0.0)
            tail = child_mod.log_tail(self.rd.attempt_dir(flight.number) / "child.log")
            failure = classify_exit(exit_, report, tail, 0, None, None)
            self.log.info(
                "failure_classified",
                attempt=flight.number,
                kind=failure.kind.value,
                stage=failure.stage.value,
                evidence=failure.evidence,
                reclaimed=True,
            )
            return [*records, self._decide_and_record(facts, plan, records, failure, report)]
        if reader.progress.finished and self._phase_done(flight.phase):
            # It finished while nobody watched: journal the success, do not train again.
            record = self._journal(AttemptRecord.from_facts(facts, "succeeded", None))
            self.log.info("attempt_succeeded", attempt=flight.number, phase=flight.phase, reclaimed=True)
            return [*records, record]
        record = self._journal(
            AttemptRecord.from_facts(facts, "interrupted", self._resume_step(flight.knobs))
        )
        self.log.info(
            "attempt_interrupted",
            attempt=flight.number,
            steps=steps,
            resume_from=record.next_resume_from,
            why="the supervisor stopped while this attempt ran; its config is not counted as failed",
        )
        return [*records, record]


def _failed_report(report: ErrorReport | None) -> bool:
    """A report of a real failure (not of the graceful stop we asked for)."""
    return report is not None and report.exit_code not in (ExitCode.OK, ExitCode.STOPPED)


def _child_peak(heartbeat_peak: int | None, report: ErrorReport | None) -> int | None:
    """The child's peak: heartbeats miss the last moments before an OOM; the report's stats do not."""
    stats = report.memory_stats if report and report.memory_stats else {}
    reported = stats.get("allocated_bytes.all.peak")
    peaks = [p for p in (heartbeat_peak, reported) if isinstance(p, int)]
    return max(peaks) if peaks else None


__all__ = ["Plan", "Seams", "Stage", "Supervisor"]
