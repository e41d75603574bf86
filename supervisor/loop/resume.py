"""Which checkpoint an attempt resumes from, judged from the checkpoint's own marker (its knobs, each
file's size and sha256), newest first: damaged files are skipped (and quarantined when asked); an
adapter of another model or a smaller LoRA rank (or alpha) is skipped; a larger rank is cut by SVD
in the child; another optimizer (or ``fresh_optimizer_state``) loads without its optimizer state.
An attempt made ready to spawn (:class:`Prepared`) is on disk before ``state.json`` names it in flight:
its resume checkpoint chosen and its spec written."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.loop.child import Clock, Seams
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.journal import InFlight, Phase
from qlora_supervise.supervisor.record.rundir import AttemptDir, RunDir, ensure_dir
from qlora_supervise.trainer_child.contract import checkpoints
from qlora_supervise.trainer_child.contract.durable import write_text_atomic
from qlora_supervise.trainer_child.contract.processes import pid_alive
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, Knobs


@dataclass(frozen=True)
class Quarantined:
    """A checkpoint moved out of the way: where it was, where it went, and why."""

    path: Path
    moved_to: Path
    why: str


@dataclass(frozen=True)
class ResumePoint:
    step: int
    path: Path | None
    reset_optimizer: bool
    skipped: tuple[str, ...] = ()  # checkpoints passed over, with why
    quarantined: tuple[Quarantined, ...] = ()
    rank_from: int | None = None  # the child cuts the adapter from this larger rank to the knobs'


def resume_point(checkpoints_dir: Path, knobs: Knobs, *, quarantine_damaged: bool = False) -> ResumePoint:
    """The newest complete, intact checkpoint these knobs can load (step 0 and no path: none).
    With ``quarantine_damaged`` a checkpoint whose files differ from its marker is moved aside;
    without it (the arbiter's prediction of the next resume step) it is only skipped."""
    skipped: list[str] = []
    moved: list[Quarantined] = []
    for step, path in reversed(checkpoints.complete_checkpoints(checkpoints_dir)):
        marker = checkpoints.read_marker(path)
        saved = marker.get("knobs", {}) if marker is not None else None
        damaged = checkpoints.damaged_files(path) if isinstance(saved, dict) else None
        if saved is None or damaged is None:
            skipped.append(f"{path.name}: unreadable marker")
            continue
        why = "; ".join(f"{name}: {problem}" for name, problem in sorted(damaged.items()))
        # Only the optimizer state damaged: resume the adapter and step with a fresh optimizer.
        optimizer_only = bool(damaged) and set(damaged) <= set(checkpoints.OPTIMIZER_FILES)
        if damaged and not optimizer_only:
            skipped.append(f"{path.name}: damaged ({why})")
            if quarantine_damaged:
                reason = f"files differ from the completion marker: {why}"
                moved.append(Quarantined(path, checkpoints.quarantine(path, reason), reason))
            continue
        if optimizer_only:
            skipped.append(f"{path.name}: optimizer state damaged ({why}); resumed with a fresh optimizer")
        if not saved:  # a marker without knobs (written by hand or another tool): trust its shape
            return ResumePoint(step, path, optimizer_only, tuple(skipped), tuple(moved))
        rank = saved.get("lora_r")
        rank_from = rank if type(rank) is int and rank > knobs.lora_r else None  # JSON's int, not a bool
        # A larger rank is cut down by SVD, its alpha rescaled with it: only the model must match.
        names = ("model",) if rank_from is not None else ("model", "lora_r", "lora_alpha")
        if differs := [name for name in names if saved.get(name) != getattr(knobs, name)]:
            skipped.append(f"{path.name}: adapter differs in {', '.join(differs)}")
            continue
        # Another optimizer, the fresh_optimizer_state rung against a checkpoint written before it, or
        # the other FSDP mode (its optimizer state has its own layout): the optimizer state is not loaded.
        flags = ("fresh_optimizer_state", "fsdp")
        changed = saved.get("optimizer") != knobs.optimizer
        changed = changed or any(bool(saved.get(name, False)) != getattr(knobs, name) for name in flags)
        reset = optimizer_only or rank_from is not None or changed
        return ResumePoint(step, path, reset, tuple(skipped), tuple(moved), rank_from)
    return ResumePoint(0, None, False, tuple(skipped), tuple(moved))


def quarantine_reported(report: ErrorReport | None, checkpoints_dir: Path) -> Quarantined | None:
    """Move aside the checkpoint a child could not load (its report names it); None when it names
    none, or something that is not one of this run's checkpoints."""
    if report is None or not report.damaged_checkpoint:
        return None
    path = Path(report.damaged_checkpoint)
    if path.parent.resolve() != checkpoints_dir.resolve() or not path.is_dir():
        return None
    reason = f"failed to load in the child: {report.exception_type}: {report.message[:300]}"
    return Quarantined(path, checkpoints.quarantine(path, reason), reason)


def clean_staging(run_root: Path, checkpoints_dir: Path) -> list[Path]:
    """When a run ends, whatever the verdict: delete staging directories whose writer (its pid in
    the name) is gone: ``.tmp-*`` under ``checkpoints/``, ``.tmp-adapter-<pid>`` / ``.old-adapter-<pid>``."""
    removed = checkpoints.remove_stale_temps(checkpoints_dir)
    if not run_root.is_dir():
        return removed
    for path in run_root.iterdir():
        tail = path.name.rsplit("-", 1)[-1]
        ours = path.name.startswith((checkpoints.TEMP_PREFIX, ".old-")) and tail.isdigit()
        if ours and path.is_dir() and not pid_alive(int(tail)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def log_quarantined(log: FilteringBoundLogger, moved: tuple[Quarantined, ...] | list[Quarantined]) -> None:
    """One ``checkpoint_quarantined`` warning per checkpoint moved aside."""
    for item in moved:
        log.warning(
            Event.CHECKPOINT_QUARANTINED,
            checkpoint=item.path.name,
            moved_to=str(item.moved_to),
            why=item.why,
            resume="the next attempt resumes from the newest checkpoint still intact",
        )


@dataclass(frozen=True)
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
