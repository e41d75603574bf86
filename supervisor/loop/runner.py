"""The attempt runner: ``prepare`` (checkpoint chosen, spec written), ``spawn`` and ``run`` (watched
to its end). The arbiter writes ``state.json`` between them; the runner writes no state."""

from __future__ import annotations

import dataclasses
import os
import signal
from collections.abc import Callable
from pathlib import Path

from structlog.typing import FilteringBoundLogger

from qlora_supervise.policies.choice import RETIME_RUNG
from qlora_supervise.supervisor.diagnosis import xid
from qlora_supervise.supervisor.facts.failure import ChildExit, KilledBy
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.loop import child as child_mod
from qlora_supervise.supervisor.loop import child_output as output
from qlora_supervise.supervisor.loop.child import ChildHandle, Seams
from qlora_supervise.supervisor.loop.climb_back import ClimbBack, PlannedRestart, remaining_s
from qlora_supervise.supervisor.loop.outcome import AttemptOutcome, optimizer_reset
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.loop.resume import Prepared, prepare_checkpoints, write_spec
from qlora_supervise.supervisor.loop.spare import SpareKeeper, SpareOrder, runs_in_spare, spare_enabled
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.history import speed_of
from qlora_supervise.supervisor.record.journal import Phase
from qlora_supervise.supervisor.record.rundir import RunDir, ensure_dir
from qlora_supervise.supervisor.reporting import notify
from qlora_supervise.supervisor.reporting.outputs import Reporter
from qlora_supervise.supervisor.trainers.trainer import note_shim, output_moving, trainer_env
from qlora_supervise.supervisor.watching import watch
from qlora_supervise.supervisor.watching.gpu import GpuProbe, RankCards
from qlora_supervise.trainer_child.contract import events as child_events
from qlora_supervise.trainer_child.contract.spec import EARLY_CHECKPOINT_SIGNAL, Knobs


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
    gpu_budget: int | None  # the policy's GPU budget: what memory creep is measured against
    climb: ClimbBack  # asked at each checkpoint: a planned restart to a faster config


class AttemptRunner:
    """Runs one attempt to its end and reports what it saw."""

    def __init__(self, ctx: RunnerContext) -> None:
        self.ctx = ctx
        on, why = spare_enabled(ctx.job.supervise.warm_spare)
        if ctx.seams.spawn_spare is None or not on:
            ctx.log.info(Event.SPARE_OFF, why=why if not on else "no spare seam (a test's fake spawn)")
        spawn = ctx.seams.spawn_spare if on else None
        self.spares = SpareKeeper(ctx.rd.root, spawn, ctx.seams.clock, ctx.seams.sleep, ctx.log)
        self.failed_at: float | None = None  # when the last attempt failed: its successor's first_step
        self.warm = False  # the attempt in flight runs in a spare
        self.spare_due: SpareOrder | None = None  # a spare to start behind the attempt in flight
        self.planned: PlannedRestart | None = None  # the attempt in flight is stopped for a faster config
        self.cards: RankCards | None = None  # every rank's card, while a torchrun attempt runs
        self.log = ctx.log  # bound to the attempt in flight

    def _start_due_spare(self) -> None:
        if self.spare_due is not None:
            self.spares.ensure(self.spare_due)
        self.spare_due = None

    def close(self) -> None:
        """The run is over: its spare, if any, goes too."""
        self.spares.discard("the run is over")

    def prepare(self, number: int, plan: Plan) -> Prepared:
        ctx = self.ctx
        log = ctx.log.bind(attempt=number)
        resume = prepare_checkpoints(ctx.rd, number, plan, ctx.seams.wall, log)
        spec = write_spec(ctx.job, ctx.rd, number, plan, resume, ctx.seams, log)
        return Prepared(number, plan, resume, spec, ctx.seams.wall(), ctx.seams.oom_kills())

    def run(self, ready: Prepared, proc: ChildHandle) -> AttemptOutcome:
        """Watch the spawned attempt to its end, stop it if the watch ended first, read what it left."""
        ctx, seams = self.ctx, self.ctx.seams
        number, plan, resume, spec = ready.number, ready.plan, ready.resume, ready.spec
        self.log = log = ctx.log.bind(attempt=number)
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
        reader = watch.HeartbeatReader(Path(spec.events_file))
        self.planned = None
        ctx.climb.start()
        self.cards = seams.open_cards(plan.knobs, ctx.job.resources.device)
        try:
            watched = self._watch(ready, proc, reader)
            if watched.stopped_by_signal:
                self.spare_due = None  # the run stops: no attempt will need it
            self._start_due_spare()  # the attempt ended before its first step: the next may need one
            killed = KilledBy.HANG if watched.hang else (KilledBy.STOP if watched.stopped_by_signal else None)
            if self.planned is not None and killed is None:
                killed = KilledBy.STEP_UP
            if (code := proc.poll() if killed is None else None) is None:
                # A hung process (or ranks left in a broken collective) gets the short grace.
                short = watched.hang or watched.ranks_overstayed
                code = proc.stop(ctx.job.supervise.hang_grace if short else seams.stop_grace_s)
            duration_s = seams.clock() - proc.started_monotonic
            exit_ = ChildExit(code if code >= 0 else None, -code if code < 0 else None, killed, duration_s)
            # One more NVML sample after the exit (a crash's Xid may come late), then any ``gpu_fault``.
            if ctx.gpu is not None or self.cards is not None:
                self._sample(proc.pid, watched, ctx.rd.attempt(number).gpu)
            if watched.xid_events:
                xids, fatal = list(dict.fromkeys(watched.xid_events)), xid.fatal_xid(watched.xid_events)
                meanings = xid.describe(watched.xid_events)
                log.error(Event.GPU_FAULT, xids=xids, meanings=meanings, fatal=fatal is not None)
        finally:
            if self.cards is not None:
                self.cards.close()
            self.cards = None
        # Read what the child wrote while it stopped: the step it finished after our SIGTERM
        # and before its checkpoint counts (it would otherwise be missed by one).
        output.note_child_events(reader.poll(seams.clock()), log)
        ctx.display.clear()
        peaks = output.note_rank_peaks(spec, reader.progress, log)
        log.info(
            Event.CHILD_EXITED,
            exit_code=exit_.returncode,
            signal=exit_.signal,
            killed_by_supervisor=exit_.killed_by_supervisor,
            duration_s=round(exit_.duration_s, 1),
            step=reader.progress.step,
            **({"rank_peaks": {str(rank): peak for rank, peak in peaks.items()}} if peaks else {}),
            **output.card_fields(watched),
        )
        # The adapter and the LR schedule follow the step, the moments do not.
        if (reset := optimizer_reset(reader.progress)) is not None:
            log.warning(Event.OPTIMIZER_RESET, why=reset, lr_schedule="restored at the resumed step")
        note_shim(spec, log)  # a tool's attempt: did our shim speak for it?
        kills_after = seams.oom_kills()
        o = output.ended(ctx.rd, ready.in_flight(proc.pid), plan, reader.progress, seams.wall(), log)
        # When it failed (its report's time, else the end of the watch): the next first_step times from it.
        self.failed_at = None if exit_.returncode == 0 else (o.report.time if o.report else seams.wall())
        return dataclasses.replace(
            o,
            exit=exit_,
            planned=self.planned,
            memory=watched,
            oom_kill_delta=(kills_after or 0) - (ready.oom_kills_before or 0),
        )

    def spawn(self, ready: Prepared) -> ChildHandle:
        """Start the prepared attempt: in a warm spare when one fits it, else a fresh child."""
        ctx, seams = self.ctx, self.ctx.seams
        number, plan = ready.number, ready.plan
        files = ctx.rd.attempt(number)
        argv = seams.argv(files.spec, plan.phase.value)
        env = trainer_env(child_mod.child_env(dict(os.environ), plan.knobs), ready.spec, files.spec)
        # The datasets cache stays in the run directory, unless the caller chose a place (HF_HOME).
        if not {"HF_DATASETS_CACHE", "HF_HOME"} & env.keys():
            env["HF_DATASETS_CACHE"] = str(ensure_dir(ctx.rd.datasets_cache))
        # What a spare for this attempt must have been started with; None when a spare cannot run it.
        order, spare, knobs, device = None, None, plan.knobs, ctx.job.resources.device
        train = plan.phase is Phase.TRAIN and ctx.job.trainer.spare
        if runs_in_spare(argv, child_mod.child_argv(files.spec, plan.phase.value), train, knobs.world_size):
            order = SpareOrder(env, device, knobs.expandable_segments, knobs.model, files.spec)
            spare = self.spares.take(order, files.spec, files.log)
        else:  # a merge or torchrun: the spare's RAM is theirs now
            self.spares.discard("this attempt cannot run in a spare")
        self.warm = spare is not None
        cwd = ctx.job.trainer.cwd(ctx.job.job_file.parent, ctx.rd.root, ready.spec.command)
        proc: ChildHandle = spare or seams.spawn(argv, env, files.log, cwd)
        notify.status(f"attempt {number} ({plan.phase.value}) running, pid {proc.pid}")
        # The next spare: behind a cold start at once (in ``run``, once the pid is written); behind a
        # warm start only after its first step, so its imports never slow the recovery they shorten.
        self.spare_due = order
        return proc

    def _watch(self, ready: Prepared, proc: ChildHandle, reader: watch.HeartbeatReader) -> watch.Watched:
        # One tick: read heartbeats, report progress (which feeds systemd's watchdog), sample memory,
        # then the ways a watch ends early (a planned restart, a stop, ranks overstaying, a hang).
        ctx, seams, spec, number, log = self.ctx, self.ctx.seams, ready.spec, ready.number, self.log
        creep = watch.CreepWatch(ctx.gpu_budget, spec.cpu_memory_limit, first_step=ready.resume.step)
        first = output.FirstStep(ready.resume.step, ready.started_at, self.failed_at, self.warm)
        if spec.train.max_steps > 0:
            reader.progress.max_steps = spec.train.max_steps
        watched = watch.Watched(reader.progress)
        started = next_sample = seams.clock()
        files = ctx.rd.attempt(number)
        hup_logged = False
        hang_timeout = ctx.job.supervise.hang_timeout
        while proc.poll() is None:
            now = seams.clock()
            new = reader.poll(now)
            output.note_child_events(new, log)
            if first.note(new, log):
                self._start_due_spare()
            self._note_creep(new, creep, proc.pid, watched)
            ctx.display.update(number, reader.progress, now)
            if now >= next_sample:
                self._sample(proc.pid, watched, files.gpu)
                ctx.climb.sample(now, watched)
                next_sample = now + seams.sample_every_s
            if self._planned_restart(new, spec.knobs, reader.progress, now):
                return watched
            if ctx.hup_seen() and not hup_logged:
                log.info(Event.SIGHUP_IGNORED, why="the job is read once at start; restart to change it")
                hup_logged = True
            if (stop := ctx.stop_signal()) is not None:
                watched.stopped_by_signal = stop
                ctx.display.clear()
                log.info(
                    Event.STOP_REQUESTED,
                    signal=signal.Signals(stop).name,
                    grace_s=seams.stop_grace_s,
                    why="the child checkpoints and exits; run the same command again to resume",
                )
                return watched
            output.note_rank_exits(spec, watched, now)
            if output.ranks_overstay(spec, watched, now, self.ctx.seams.rank_shutdown_s, log):
                watched.ranks_overstayed = True
                return watched
            quiet = watch.hung(reader.progress, started, now, hang_timeout)
            # A tool whose shim never spoke: its log's growth stands in for heartbeats.
            if quiet and not output_moving(spec, files.log, seams.wall(), hang_timeout):
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
        self, events: list[child_events.ChildEvent], knobs: Knobs, progress: watch.Progress, now: float
    ) -> bool:
        """At a checkpoint the child saved: whether to stop it for a faster config (climb_back.py)."""
        climb = self.ctx.climb
        if knobs.world_size > 1:
            return False
        if any(isinstance(event, child_events.SpeedTrialEvent) for event in events):
            climb.trial_seen(now)
        saves = (e for e in events if isinstance(e, child_events.CheckpointSaved))
        last_step = progress.finished or (progress.max_steps and progress.step >= progress.max_steps)
        if not any(e.step and not e.emergency for e in saves) or last_step:
            return False  # no regular save, or the final one: nothing is left to train faster
        knobs = speed_of(progress.events, knobs).knobs
        if (planned := climb.at_checkpoint(knobs, progress.step, now, remaining_s(progress, knobs))) is None:
            return False
        self.planned = planned
        self.ctx.display.clear()
        self.log.info(
            Event.RETIME if planned.rung == RETIME_RUNG else Event.STEP_UP,
            step=progress.step,
            why=planned.why,
            changes={name: list(pair) for name, pair in planned.changes.items()},
            **({"undoes_attempt": planned.undoes} if planned.undoes is not None else {}),
        )
        return True

    def _note_creep(
        self, events: list[child_events.ChildEvent], creep: watch.CreepWatch, pid: int, watched: watch.Watched
    ) -> None:
        """Feed new heartbeats to the creep rule; once it fires, log it and ask for an early checkpoint."""
        for event in (e for e in events if isinstance(e, child_events.Heartbeat)):
            if (forecast := creep.observe(event)) is None:
                continue
            if forecast.asks_for_checkpoint:
                self.ctx.seams.signal_child(pid, EARLY_CHECKPOINT_SIGNAL)
            watched.creep = forecast
            self.ctx.display.clear()
            self.log.warning(
                Event.MEMORY_CREEP,
                step=forecast.step,
                peak_bytes=forecast.peak_bytes,
                slope_bytes_per_step=round(forecast.slope_bytes_per_step),
                budget_bytes=forecast.budget_bytes,
                predicted_oom_step=forecast.predicted_oom_step,
                window_steps=forecast.window_steps,
                early_checkpoint_requested=forecast.asks_for_checkpoint,
            )

    def _sample(self, pid: int, watched: watch.Watched, gpu_log: Path) -> None:
        if self.cards is not None:
            watch.sample_cards(pid, watched, self.cards, gpu_log)
        else:
            watch.sample_memory(pid, watched, self.ctx.gpu, gpu_log)
