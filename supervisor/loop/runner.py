"""The attempt runner: checkpoints chosen, spec written, child spawned, watched, ended.

It returns an :class:`~.outcome.AttemptOutcome` and judges nothing: the arbiter does that,
through the same path the reclaim uses.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.diagnosis import xid
from qlora_supervise.supervisor.diagnosis.failure import ChildExit, KilledBy
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.loop import child as child_mod
from qlora_supervise.supervisor.loop.child_output import (
    log_optimizer_reset,
    note_child_events,
    note_rank_peaks,
    read_reports,
    report_of,
)
from qlora_supervise.supervisor.loop.outcome import AttemptOutcome, MemorySeen
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.loop.recovery import FirstStep, failure_time
from qlora_supervise.supervisor.loop.resume import ResumePoint, log_quarantined, resume_point
from qlora_supervise.supervisor.loop.seams import ChildHandle, Seams
from qlora_supervise.supervisor.loop.spare import SpareKeeper, SpareOrder, runs_in_spare, spare_enabled
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.journal import InFlight, RunState, State, write_state
from qlora_supervise.supervisor.record.records import Phase
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.record.runfiles import ensure_dir
from qlora_supervise.supervisor.reporting import notify
from qlora_supervise.supervisor.reporting.reporter import Reporter
from qlora_supervise.supervisor.watching.creep import CreepWatch
from qlora_supervise.supervisor.watching.gpu import GpuProbe
from qlora_supervise.supervisor.watching.heartbeats import HeartbeatReader
from qlora_supervise.supervisor.watching.watch import Watched, hung, sample_memory
from qlora_supervise.trainer_child.contract.durable import write_text_atomic
from qlora_supervise.trainer_child.contract.events import Heartbeat
from qlora_supervise.trainer_child.contract.spec import EARLY_CHECKPOINT_SIGNAL, AttemptSpec


@dataclasses.dataclass
class RunnerContext:
    """What the runner shares with the arbiter: its seams, log, GPU probe and stop flag."""

    job: Job
    rd: RunDir
    seams: Seams
    log: Any
    display: Reporter  # console, sd_notify STATUS/WATCHDOG (fed by the child's events), metrics
    gpu: GpuProbe | None
    stop_signal: Callable[[], int | None]
    hup_seen: Callable[[], bool]
    gpu_budget: int | None = None  # the policy's GPU budget: what memory creep is measured against


class AttemptRunner:
    """Runs one attempt to its end and reports what it saw."""

    def __init__(self, ctx: RunnerContext) -> None:
        self.ctx = ctx
        self.spares = self._spare_keeper()
        # When the last attempt failed (its error report's time, else its end): the next
        # attempt's ``first_step`` says how long the recovery took from there.
        self.failed_at: float | None = None
        self.warm = False  # the attempt in flight runs in a spare
        self.spare_due: SpareOrder | None = None  # a spare to start behind the attempt in flight

    def _spare_keeper(self) -> SpareKeeper | None:
        ctx = self.ctx
        on, why = spare_enabled(ctx.job.supervise.warm_spare)
        if ctx.seams.spawn_spare is None or not on:
            ctx.log.info(Event.SPARE_OFF, why=why if not on else "no spare seam (a test's fake spawn)")
            return None
        return SpareKeeper(
            ctx.rd.root, ctx.seams.spawn_spare, ctx.seams.clock, ctx.seams.sleep, ctx.log, sys.executable
        )

    def _start_due_spare(self) -> None:
        if self.spare_due is not None and self.spares is not None:
            self.spares.ensure(self.spare_due)
        self.spare_due = None

    def close(self) -> None:
        """The run is over: its spare, if any, goes too."""
        if self.spares is not None:
            self.spares.discard("the run is over")

    def run(self, number: int, plan: Plan) -> AttemptOutcome:
        # One attempt's whole life in the order it happens (checkpoints, spec, spawn, watch,
        # end, last read), kept in one place so the order that crash safety needs is visible.
        ctx, seams = self.ctx, self.ctx.seams
        log = ctx.log.bind(attempt=number)
        resume = self._prepare_checkpoints(number, plan, log)
        spec = self._write_spec(number, plan, resume, log)
        started_at = seams.wall()
        attempt_dir = ctx.rd.attempt_dir(number)
        kills_before = seams.oom_kills()
        proc = self._spawn(number, plan, resume, started_at)
        log.info(
            Event.ATTEMPT_STARTED,
            phase=plan.phase.value,
            pid=proc.pid,
            resumed_from=resume.step,
            reset_optimizer=spec.reset_optimizer,
            rank_from=resume.rank_from,
            knobs=dataclasses.asdict(plan.knobs),
            effective_batch=plan.knobs.effective_batch,
        )
        reader = HeartbeatReader(Path(spec.events_file))
        creep = CreepWatch(ctx.gpu_budget, spec.cpu_memory_limit, first_step=resume.step)
        first = FirstStep(resume.step, started_at, self.failed_at, self.warm)
        watched = self._watch(number, proc, reader, spec, log, creep, first)
        if watched.stopped_by_signal:
            self.spare_due = None  # the run stops: no attempt will need it
        self._start_due_spare()  # the attempt ended before its first step: the next may need one
        exit_ = self._end(proc, watched)
        self._last_gpu_look(proc.pid, watched, attempt_dir, log)
        # Read what the child wrote while it stopped: the step it finished after our SIGTERM
        # and before its checkpoint counts (it would otherwise be missed by one).
        note_child_events(reader.poll(seams.clock()), log)
        ctx.display.clear()
        peaks = (
            note_rank_peaks(Path(spec.events_file), reader.progress, log) if spec.knobs.world_size > 1 else {}
        )
        log.info(
            Event.CHILD_EXITED,
            exit_code=exit_.returncode,
            signal=exit_.signal,
            killed_by_supervisor=exit_.killed_by_supervisor,
            duration_s=round(exit_.duration_s, 1),
            step=reader.progress.step,
            **({"rank_peaks": {str(rank): peak for rank, peak in peaks.items()}} if peaks else {}),
        )
        log_optimizer_reset(log, reader.progress)
        kills_after = seams.oom_kills()
        reports = read_reports(ctx.rd, number, ctx.log)  # once: an unreadable one is logged once
        report = report_of(reports)
        self.failed_at = None if exit_.returncode == 0 else failure_time(report, seams.wall())
        return AttemptOutcome(
            number=number,
            plan=plan,
            exit=exit_,
            progress=reader.progress,
            report=report,
            reports=reports if plan.knobs.world_size > 1 else (),
            memory=MemorySeen(
                watched.gpu_peak_process,
                watched.gpu_others_at_end,
                watched.gpu_total,
                watched.rss_peak,
                tuple(watched.xid_events),
            ),
            resumed_from=resume.step,
            started_at=started_at,
            ended_at=seams.wall(),
            log_tail=child_mod.log_tail(attempt_dir / "child.log"),
            oom_kill_delta=(kills_after or 0) - (kills_before or 0),
        )

    def _spawn(self, number: int, plan: Plan, resume: ResumePoint, started_at: float) -> ChildHandle:
        ctx, seams = self.ctx, self.ctx.seams
        attempt_dir = ctx.rd.attempt_dir(number)
        argv = seams.argv(attempt_dir / "spec.json", plan.phase.value)
        env = child_mod.child_env(dict(os.environ), plan.knobs)
        # In flight before the spawn (pid unknown) and again after it: a supervisor killed in
        # between leaves a state that names the attempt, so its child can be found and stopped.
        flight = InFlight(number, plan.phase, plan.knobs, resume.step, None, started_at)
        write_state(ctx.rd.state, State(RunState.RUNNING, plan.knobs, plan.phase, flight))
        order = self._spare_order(argv, attempt_dir / "spec.json", plan, env)
        spare = None
        if self.spares is not None and order is not None:
            spare = self.spares.take(order, attempt_dir / "spec.json", attempt_dir / "child.log")
        elif self.spares is not None:  # a merge or torchrun: the spare's RAM is theirs now
            self.spares.discard("this attempt cannot run in a spare")
        self.warm = spare is not None
        proc: ChildHandle = spare or seams.spawn(argv, env, attempt_dir / "child.log", ctx.rd.root)
        notify.status(f"attempt {number} ({plan.phase.value}) running, pid {proc.pid}")
        flight = dataclasses.replace(flight, pid=proc.pid)
        write_state(ctx.rd.state, State(RunState.RUNNING, plan.knobs, plan.phase, flight))
        # The next spare: behind a cold start at once (the child imports as long as the spare
        # does, so nothing is slowed); behind a warm start only after its first step, so the
        # spare's imports never compete with the recovery they exist to shorten.
        self.spare_due = order
        if not self.warm:
            self._start_due_spare()
        return proc

    def _spare_order(
        self, argv: list[str], spec_path: Path, plan: Plan, env: dict[str, str]
    ) -> SpareOrder | None:
        """What a spare for this attempt must have been started with; None when a spare cannot
        run it: one training process (never torchrun's ranks, a merge or a test's scripted
        child), started with exactly the trainer's own command line."""
        trainer_argv = child_mod.child_argv(spec_path, plan.phase.value)
        if not runs_in_spare(argv, trainer_argv, plan.phase is Phase.TRAIN, plan.knobs.world_size):
            return None
        device, expandable = self.ctx.job.resources.device, plan.knobs.expandable_segments
        return SpareOrder(env, device, expandable, plan.knobs.model, prepare_from=spec_path)

    def _end(self, proc: ChildHandle, watched: Watched) -> ChildExit:
        seams = self.ctx.seams
        killed = KilledBy.HANG if watched.hang else (KilledBy.STOP if watched.stopped_by_signal else None)
        code = proc.poll() if killed is None else None
        if code is None:
            # A hung process cannot use a long grace to checkpoint: it gets the short one.
            grace = self.ctx.job.supervise.hang_grace if watched.hang else seams.stop_grace_s
            code = proc.stop(grace, seams.sleep)
        return ChildExit(
            returncode=code if code >= 0 else None,
            signal=-code if code < 0 else None,
            killed_by_supervisor=killed,
            duration_s=seams.clock() - proc.started_monotonic,
        )

    def _prepare_checkpoints(self, number: int, plan: Plan, log: Any) -> ResumePoint:
        """Resume point of the next attempt: the newest complete checkpoint its knobs can load."""
        rd = self.ctx.rd
        if plan.phase is Phase.MERGE:
            return ResumePoint(0, None, False)
        if plan.fresh_start and rd.checkpoints.exists():
            # Old checkpoints hold an adapter of another shape: keep them for the user, out of the way.
            target = rd.superseded_checkpoints(number)
            if target.exists():
                target = target.with_name(f"{target.name}.{int(self.ctx.seams.wall())}")
            rd.checkpoints.rename(target)
            log.info(Event.CHECKPOINTS_SUPERSEDED, moved_to=str(target))
        point = resume_point(rd.checkpoints, plan.knobs, quarantine_damaged=True)
        log_quarantined(log, point.quarantined)
        if point.skipped:
            log.info(Event.CHECKPOINTS_SKIPPED, skipped=list(point.skipped))
        return point

    def _write_spec(self, number: int, plan: Plan, resume: ResumePoint, log: Any) -> AttemptSpec:
        job, rd = self.ctx.job, self.ctx.rd
        directory = rd.attempt_dir(number)
        if directory.exists():
            # Left by an attempt the journal never recorded (the supervisor died between spawn and
            # state.json): its error report must not be read as this attempt's.
            aside = directory.with_name(f"{directory.name}.unrecorded-{int(self.ctx.seams.wall())}")
            directory.rename(aside)
            log.warning(Event.UNRECORDED_ATTEMPT_MOVED, moved_to=str(aside))
        spec = AttemptSpec(
            attempt=number,
            run_dir=str(rd.root),
            knobs=plan.knobs,
            data=job.data,
            train=job.train,
            events_file=str(directory / "child-events.jsonl"),
            error_file=str(directory / "error.json"),
            checkpoints_dir=str(rd.checkpoints),
            adapter_dir=str(rd.adapter),
            merged_dir=str(rd.merged),
            device=job.resources.device,
            gpu_memory_limit=job.resources.gpu_memory_limit,
            cpu_memory_limit=job.resources.cpu_memory_limit,
            resume_from=str(resume.path) if resume.path else None,
            # The checkpoint itself says whether its optimizer state fits these knobs.
            reset_optimizer=resume.reset_optimizer,
            diagnose=job.diagnose,
            stop_grace_s=self.ctx.seams.stop_grace_s,
        )
        ensure_dir(directory)
        write_text_atomic(directory / "spec.json", spec.to_json())
        return spec

    def _watch(
        self,
        number: int,
        proc: ChildHandle,
        reader: HeartbeatReader,
        spec: AttemptSpec,
        log: Any,
        creep: CreepWatch,
        first: FirstStep,
    ) -> Watched:
        # One tick: read heartbeats, report progress (systemd's watchdog is fed there, by the
        # child's events, not by this timer), sample memory, then the ways a watch ends early
        # (a stop signal, a hang) before the child's own exit.
        ctx, seams = self.ctx, self.ctx.seams
        if spec.train.max_steps > 0:
            reader.progress.max_steps = spec.train.max_steps
        watched = Watched(reader.progress)
        started = next_sample = seams.clock()
        gpu_log = ctx.rd.attempt_dir(number) / "gpu.jsonl"
        hup_logged = False
        hang_timeout = ctx.job.supervise.hang_timeout
        while proc.poll() is None:
            now = seams.clock()
            new = reader.poll(now)
            note_child_events(new, log)
            if first.note(new, log):
                self._start_due_spare()
            self._watch_creep(new, creep, proc, log, watched)
            ctx.display.update(number, reader.progress, now)
            if now >= next_sample:
                sample_memory(proc.pid, watched, ctx.gpu, gpu_log)
                next_sample = now + seams.sample_every_s
            if ctx.hup_seen() and not hup_logged:
                log.info(Event.SIGHUP_IGNORED, why="the job is read once at start; restart to change it")
                hup_logged = True
            stop = ctx.stop_signal()
            if stop is not None:
                watched.stopped_by_signal = stop
                ctx.display.clear()
                log.info(
                    Event.STOP_REQUESTED,
                    signal=signal.Signals(stop).name,
                    grace_s=seams.stop_grace_s,
                    why="the child checkpoints and exits; run the same command again to resume",
                )
                return watched
            if hung(reader.progress, started, now, hang_timeout):
                log.warning(
                    Event.HANG_DETECTED,
                    step=reader.progress.step,
                    stage=reader.progress.stage,
                    hang_timeout_s=hang_timeout,
                    grace_s=ctx.job.supervise.hang_grace,
                )
                watched.hang = True
                return watched
            proc.wait_for_exit(seams.tick_s, seams.sleep)  # woken early by the child's exit
        return watched

    def _last_gpu_look(self, pid: int, watched: Watched, attempt_dir: Path, log: Any) -> None:
        """One more NVML sample after the exit (the Xid of a crash may come after the last
        tick's sample), then the ``gpu_fault`` line when any Xid was seen."""
        if self.ctx.gpu is not None:
            sample_memory(pid, watched, self.ctx.gpu, attempt_dir / "gpu.jsonl")
        if watched.xid_events:
            fatal = xid.fatal_xid(watched.xid_events)
            log.error(
                Event.GPU_FAULT,
                xids=list(dict.fromkeys(watched.xid_events)),
                meanings=xid.describe(watched.xid_events),
                fatal=fatal is not None,
            )

    def _watch_creep(
        self, events: list[dict[str, Any]], creep: CreepWatch, proc: ChildHandle, log: Any, watched: Watched
    ) -> None:
        """Feed new heartbeats to the creep rule; once it fires, log it and ask for a checkpoint."""
        for event in events:
            beat = Heartbeat.from_fields(event) if event.get("event") == "heartbeat" else None
            forecast = creep.observe(beat) if beat is not None else None
            if forecast is None:
                continue
            if forecast.asks_for_checkpoint:
                self.ctx.seams.signal_child(proc.pid, EARLY_CHECKPOINT_SIGNAL)
            watched.creep = forecast
            self.ctx.display.clear()
            log.warning(
                Event.MEMORY_CREEP,
                step=forecast.step,
                peak_bytes=forecast.peak_bytes,
                slope_bytes_per_step=round(forecast.slope_bytes_per_step),
                budget_bytes=forecast.budget_bytes,
                predicted_oom_step=forecast.predicted_oom_step,
                window_steps=forecast.window_steps,
                early_checkpoint_requested=forecast.asks_for_checkpoint,
            )
