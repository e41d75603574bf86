"""The attempt runner: checkpoints chosen, spec written, child spawned, watched, ended.

Three calls, in the order crash safety needs: :meth:`AttemptRunner.prepare` (checkpoints
chosen, spec written), :meth:`~AttemptRunner.spawn` and :meth:`~AttemptRunner.run` (watched to
its end, what it left read). The arbiter writes ``state.json`` between them (the attempt in
flight, before the spawn and again with its pid): the runner writes no state, and it returns an
:class:`~.outcome.AttemptOutcome` that it does not judge (the arbiter does, through the same
path the reclaim uses).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

from structlog.typing import FilteringBoundLogger

from qlora_supervise.policies.retime import RETIME_RUNG
from qlora_supervise.supervisor.diagnosis import xid
from qlora_supervise.supervisor.facts.failure import ChildExit, KilledBy
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.loop import child as child_mod
from qlora_supervise.supervisor.loop.child_output import (
    log_optimizer_reset,
    note_child_events,
    note_rank_peaks,
    read_reports,
    report_of,
)
from qlora_supervise.supervisor.loop.climb_back import ClimbBack, PlannedRestart, remaining_s
from qlora_supervise.supervisor.loop.creep_note import note_creep
from qlora_supervise.supervisor.loop.outcome import AttemptOutcome, MemorySeen
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.loop.prepare import Prepared, prepare_checkpoints, write_spec
from qlora_supervise.supervisor.loop.rank_parts import seal_rank_parts
from qlora_supervise.supervisor.loop.rank_watch import card_fields, note_rank_exits, ranks_overstay
from qlora_supervise.supervisor.loop.recovery import FirstStep, failure_time
from qlora_supervise.supervisor.loop.seams import ChildHandle, Seams
from qlora_supervise.supervisor.loop.spare import SpareKeeper, SpareOrder, runs_in_spare, spare_enabled
from qlora_supervise.supervisor.record.attempt_speed import speed_of
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.records import Phase
from qlora_supervise.supervisor.record.rundir import AttemptDir, RunDir
from qlora_supervise.supervisor.record.runfiles import ensure_dir
from qlora_supervise.supervisor.reporting import notify
from qlora_supervise.supervisor.reporting.reporter import Reporter
from qlora_supervise.supervisor.trainers.launch import trainer_env
from qlora_supervise.supervisor.trainers.shim_check import note_shim, output_moving
from qlora_supervise.supervisor.watching.cards import RankCards
from qlora_supervise.supervisor.watching.creep import CreepWatch
from qlora_supervise.supervisor.watching.gpu import GpuProbe
from qlora_supervise.supervisor.watching.heartbeats import HeartbeatReader
from qlora_supervise.supervisor.watching.watch import Watched, hung, sample_cards, sample_memory
from qlora_supervise.trainer_child.contract.events import CheckpointSaved, ChildEvent, SpeedTrialEvent
from qlora_supervise.trainer_child.contract.spec import AttemptSpec


@dataclasses.dataclass
class RunnerContext:
    """What the runner shares with the arbiter: its seams, log, GPU probe and stop flag."""

    job: Job
    rd: RunDir
    seams: Seams
    log: FilteringBoundLogger
    display: Reporter  # console, sd_notify STATUS/WATCHDOG (fed by the child's events), metrics
    gpu: GpuProbe | None
    stop_signal: Callable[[], int | None]
    hup_seen: Callable[[], bool]
    gpu_budget: int | None = None  # the policy's GPU budget: what memory creep is measured against
    climb: ClimbBack | None = None  # asked at each checkpoint: a planned restart to a faster config


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
        self.planned: PlannedRestart | None = None  # the attempt in flight is stopped for a faster config
        self.cards: RankCards | None = None  # every rank's card, while a torchrun attempt runs

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

    def prepare(self, number: int, plan: Plan) -> Prepared:
        """The attempt made ready to spawn: its resume checkpoint chosen and its spec written."""
        ctx = self.ctx
        log = ctx.log.bind(attempt=number)
        resume = prepare_checkpoints(ctx.rd, number, plan, ctx.seams.wall, log)
        spec = write_spec(ctx.job, ctx.rd, number, plan, resume, ctx.seams, log)
        return Prepared(number, plan, resume, spec, ctx.seams.wall(), ctx.seams.oom_kills())

    def run(self, ready: Prepared, proc: ChildHandle) -> AttemptOutcome:
        """Watch the spawned attempt to its end, stop it if the watch ended first, read what it left."""
        # The rest of one attempt's life in the order it happens (watch, end, last read).
        ctx, seams = self.ctx, self.ctx.seams
        number, plan, resume, spec = ready.number, ready.plan, ready.resume, ready.spec
        started_at = ready.started_at
        log = ctx.log.bind(attempt=number)
        attempt_dir = ctx.rd.attempt_dir(number)
        if not self.warm:
            self._start_due_spare()
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
        self.planned = None
        if ctx.climb is not None:
            ctx.climb.start()
        self.cards = seams.open_cards(plan.knobs, ctx.job.resources.device)
        try:
            watched = self._watch(number, proc, reader, spec, log, creep, first)
            if watched.stopped_by_signal:
                self.spare_due = None  # the run stops: no attempt will need it
            self._start_due_spare()  # the attempt ended before its first step: the next may need one
            exit_ = self._end(proc, watched)
            self._last_gpu_look(proc.pid, watched, attempt_dir, log)
        finally:
            if self.cards is not None:
                self.cards.close()
            self.cards = None
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
            **card_fields(watched),
        )
        log_optimizer_reset(log, reader.progress)
        note_shim(spec, log)  # a tool's attempt: did our shim speak for it?
        kills_after = seams.oom_kills()
        reports = read_reports(ctx.rd, number, ctx.log)  # once: an unreadable one is logged once
        if plan.knobs.world_size > 1:  # the ranks' emergency parts, sealed when they agree
            reports = seal_rank_parts(Path(spec.checkpoints_dir), reports, plan.knobs, log)
        report = report_of(reports)
        self.failed_at = None if exit_.returncode == 0 else failure_time(report, seams.wall())
        return AttemptOutcome(
            number=number,
            plan=plan,
            exit=exit_,
            progress=reader.progress,
            report=report,
            reports=reports if plan.knobs.world_size > 1 else (),
            planned=self.planned,
            memory=MemorySeen(
                watched.gpu_peak_process,
                watched.gpu_others_at_end,
                watched.gpu_total,
                watched.rss_peak,
                tuple(watched.xid_events),
                cards=dict(watched.cards),
                card_xids={rank: tuple(x) for rank, x in watched.card_xids.items() if x},
            ),
            resumed_from=resume.step,
            started_at=started_at,
            ended_at=seams.wall(),
            log_tail=child_mod.log_tail(AttemptDir(attempt_dir).log),
            oom_kill_delta=(kills_after or 0) - (ready.oom_kills_before or 0),
            rank_exits=dict(watched.rank_exits),
        )

    def spawn(self, ready: Prepared) -> ChildHandle:
        """Start the prepared attempt: in a warm spare when one fits it, else a fresh child."""
        ctx, seams = self.ctx, self.ctx.seams
        number, plan = ready.number, ready.plan
        files = ctx.rd.attempt(number)
        argv = seams.argv(files.spec, plan.phase.value)
        env = trainer_env(child_mod.child_env(dict(os.environ), plan.knobs), ready.spec, files.spec)
        # The datasets library's cache (the prepared and tokenized data) stays in the run directory,
        # not in ~/.cache/huggingface/datasets; a place the caller chose (HF_DATASETS_CACHE, or
        # HF_HOME as the shipped unit sets it) is kept.
        if not {"HF_DATASETS_CACHE", "HF_HOME"} & env.keys():
            env["HF_DATASETS_CACHE"] = str(ensure_dir(ctx.rd.datasets_cache))
        order = self._spare_order(argv, files.spec, plan, env)
        spare = None
        if self.spares is not None and order is not None:
            spare = self.spares.take(order, files.spec, files.log)
        elif self.spares is not None:  # a merge or torchrun: the spare's RAM is theirs now
            self.spares.discard("this attempt cannot run in a spare")
        self.warm = spare is not None
        cwd = ctx.job.trainer.cwd(ctx.job.job_file.parent, ctx.rd.root, ready.spec.command)
        proc: ChildHandle = spare or seams.spawn(argv, env, files.log, cwd)
        notify.status(f"attempt {number} ({plan.phase.value}) running, pid {proc.pid}")
        # The next spare: behind a cold start at once (``run`` starts it, after the arbiter has
        # written the pid: the child imports as long as the spare does, so nothing is slowed);
        # behind a warm start only after its first step, so the spare's imports never compete
        # with the recovery they exist to shorten.
        self.spare_due = order
        return proc

    def _spare_order(
        self, argv: list[str], spec_path: Path, plan: Plan, env: dict[str, str]
    ) -> SpareOrder | None:
        """What a spare for this attempt must have been started with; None when a spare cannot
        run it: one training process (never torchrun's ranks, a merge or a test's scripted
        child), started with exactly the trainer's own command line."""
        trainer_argv = child_mod.child_argv(spec_path, plan.phase.value)
        # A spare holds our trainer's imports: a tool's attempt never runs in one.
        train = plan.phase is Phase.TRAIN and self.ctx.job.trainer.spare
        if not runs_in_spare(argv, trainer_argv, train, plan.knobs.world_size):
            return None
        device, expandable = self.ctx.job.resources.device, plan.knobs.expandable_segments
        return SpareOrder(env, device, expandable, plan.knobs.model, prepare_from=spec_path)

    def _end(self, proc: ChildHandle, watched: Watched) -> ChildExit:
        seams = self.ctx.seams
        killed = KilledBy.HANG if watched.hang else (KilledBy.STOP if watched.stopped_by_signal else None)
        if self.planned is not None and killed is None:
            killed = KilledBy.STEP_UP
        code = proc.poll() if killed is None else None
        if code is None:
            # A hung process cannot use a long grace to checkpoint: it gets the short one (so do
            # ranks left in a collective another rank's failure broke).
            short = watched.hang or watched.ranks_overstayed
            grace = self.ctx.job.supervise.hang_grace if short else seams.stop_grace_s
            code = proc.stop(grace)
        return ChildExit(
            returncode=code if code >= 0 else None,
            signal=-code if code < 0 else None,
            killed_by_supervisor=killed,
            duration_s=seams.clock() - proc.started_monotonic,
        )

    def _watch(
        self,
        number: int,
        proc: ChildHandle,
        reader: HeartbeatReader,
        spec: AttemptSpec,
        log: FilteringBoundLogger,
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
        gpu_log = ctx.rd.attempt(number).gpu
        hup_logged = False
        hang_timeout = ctx.job.supervise.hang_timeout
        while proc.poll() is None:
            now = seams.clock()
            new = reader.poll(now)
            note_child_events(new, log)
            if first.note(new, log):
                self._start_due_spare()
            note_creep(new, creep, proc.pid, self.ctx.seams, self.ctx.display, log, watched)
            ctx.display.update(number, reader.progress, now)
            if now >= next_sample:
                self._sample(proc.pid, watched, gpu_log)
                if ctx.climb is not None:
                    ctx.climb.sample(now, watched)
                next_sample = now + seams.sample_every_s
            if self._planned_restart(new, spec, reader, now, log):
                return watched
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
            note_rank_exits(spec, watched, now)
            if ranks_overstay(spec, watched, now, self.ctx.seams.rank_shutdown_s, log):
                watched.ranks_overstayed = True
                return watched
            if hung(reader.progress, started, now, hang_timeout) and not self._output_moving(spec, number):
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

    def _planned_restart(
        self,
        events: list[ChildEvent],
        spec: AttemptSpec,
        reader: HeartbeatReader,
        now: float,
        log: FilteringBoundLogger,
    ) -> bool:
        """At a checkpoint the child saved: whether to stop it for a faster config (climb_back.py)."""
        climb = self.ctx.climb
        if climb is None or spec.knobs.world_size > 1:
            return False
        if any(isinstance(event, SpeedTrialEvent) for event in events):
            climb.trial_seen(now)
        saved = [e for e in events if isinstance(e, CheckpointSaved) and not e.emergency and e.step]
        progress = reader.progress
        last_step = progress.finished or (progress.max_steps and progress.step >= progress.max_steps)
        if not saved or last_step:  # the final save: nothing is left to train faster
            return False
        knobs = speed_of(progress.events, spec.knobs).knobs
        planned = climb.at_checkpoint(knobs, progress.step, now, remaining_s(progress, knobs))
        if planned is None:
            return False
        self.planned = planned
        self.ctx.display.clear()
        log.info(
            Event.RETIME if planned.rung == RETIME_RUNG else Event.STEP_UP,
            step=progress.step,
            why=planned.why,
            changes={name: list(pair) for name, pair in planned.changes.items()},
            **({"undoes_attempt": planned.undoes} if planned.undoes is not None else {}),
        )
        return True

    def _output_moving(self, spec: AttemptSpec, number: int) -> bool:
        """A tool whose shim never spoke: its log's growth stands in for heartbeats."""
        log = self.ctx.rd.attempt(number).log
        return output_moving(spec, log, self.ctx.seams.wall(), self.ctx.job.supervise.hang_timeout)

    def _sample(self, pid: int, watched: Watched, gpu_log: Path) -> None:
        # Under torchrun each rank's card; else the job's one card.
        if self.cards is not None:
            sample_cards(pid, watched, self.cards, gpu_log)
        else:
            sample_memory(pid, watched, self.ctx.gpu, gpu_log)

    def _last_gpu_look(
        self, pid: int, watched: Watched, attempt_dir: Path, log: FilteringBoundLogger
    ) -> None:
        """One more NVML sample after the exit (the Xid of a crash may come after the last
        tick's sample), then the ``gpu_fault`` line when any Xid was seen."""
        if self.ctx.gpu is not None or self.cards is not None:
            self._sample(pid, watched, AttemptDir(attempt_dir).gpu)
        if watched.xid_events:
            fatal = xid.fatal_xid(watched.xid_events)
            log.error(
                Event.GPU_FAULT,
                xids=list(dict.fromkeys(watched.xid_events)),
                meanings=xid.describe(watched.xid_events),
                fatal=fatal is not None,
            )
