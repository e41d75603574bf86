"""An attempt made ready to spawn, on disk before ``state.json`` names it in flight: its resume
checkpoint chosen and its spec written."""

from __future__ import annotations

import dataclasses

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.loop.resume import ResumePoint, log_quarantined, resume_point
from qlora_supervise.supervisor.loop.seams import Clock, Seams
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.journal import InFlight, Phase
from qlora_supervise.supervisor.record.rundir import AttemptDir, RunDir, ensure_dir
from qlora_supervise.trainer_child.contract.durable import write_text_atomic
from qlora_supervise.trainer_child.contract.spec import AttemptSpec


@dataclasses.dataclass(frozen=True)
class Prepared:
    """An attempt ready to spawn: its resume point chosen and its spec written."""

    number: int
    plan: Plan
    resume: ResumePoint
    spec: AttemptSpec
    started_at: float  # wall clock
    oom_kills_before: int | None  # the cgroup's OOM-kill count before the spawn

    def in_flight(self, pid: int | None = None) -> InFlight:
        """What ``state.json`` names while the attempt runs (``pid`` None: before the spawn)."""
        return InFlight(self.number, self.plan.phase, self.plan.knobs, self.resume.step, pid, self.started_at)


def prepare_checkpoints(
    rd: RunDir, number: int, plan: Plan, wall: Clock, log: FilteringBoundLogger
) -> ResumePoint:
    """Resume point of the next attempt: the newest complete checkpoint its knobs can load."""
    if plan.phase is Phase.MERGE:
        return ResumePoint(0, None, False)
    if plan.fresh_start and rd.checkpoints.exists():
        # Old checkpoints hold an adapter of another shape: keep them for the user, out of the way.
        target = rd.superseded_checkpoints(number)
        if target.exists():
            target = target.with_name(f"{target.name}.{int(wall())}")
        rd.checkpoints.rename(target)
        log.info(Event.CHECKPOINTS_SUPERSEDED, moved_to=str(target))
    point = resume_point(rd.checkpoints, plan.knobs, quarantine_damaged=True)
    log_quarantined(log, point.quarantined)
    if point.skipped:
        log.info(Event.CHECKPOINTS_SKIPPED, skipped=list(point.skipped))
    return point


def write_spec(
    job: Job,
    rd: RunDir,
    number: int,
    plan: Plan,
    resume: ResumePoint,
    seams: Seams,
    log: FilteringBoundLogger,
) -> AttemptSpec:
    """``attempt-NNN/spec.json``, written atomically: everything the child is told."""
    directory = rd.attempt_dir(number)
    if directory.exists():
        # Left by an attempt the journal never recorded: its error report must not be read as this one's.
        aside = directory.with_name(f"{directory.name}.unrecorded-{int(seams.wall())}")
        directory.rename(aside)
        log.warning(Event.UNRECORDED_ATTEMPT_MOVED, moved_to=str(aside))
    ensure_dir(directory)
    resume_from = str(resume.path) if resume.path else None
    command: tuple[str, ...] = ()
    if plan.phase is Phase.TRAIN:  # a tool's own config, per attempt (our child: none)
        command = job.trainer.attempt_argv(directory, rd.root, job.knobs, plan.knobs, resume_from)
    spec = AttemptSpec(
        attempt=number,
        run_dir=str(rd.root),
        knobs=plan.knobs,
        data=job.data,
        train=job.train,
        events_file=str(AttemptDir(directory).events),
        error_file=str(AttemptDir(directory).error),
        checkpoints_dir=str(rd.checkpoints),
        adapter_dir=str(rd.adapter),
        merged_dir=str(rd.merged),
        device=job.resources.device,
        gpu_memory_limit=job.resources.gpu_memory_limit,
        cpu_memory_limit=job.resources.cpu_memory_limit,
        resume_from=resume_from,
        reset_optimizer=resume.reset_optimizer,
        diagnose=job.diagnose,
        stop_grace_s=seams.stop_grace_s,
        speed_trial=plan.speed_trial,  # attempt 1 only: the planner's fastest candidates
        speed_trial_limit_bytes=plan.speed_trial_limit,
        speed_trial_on_resume=plan.retime,
        command=command,
    )
    write_text_atomic(AttemptDir(directory).spec, spec.to_json())
    return spec
