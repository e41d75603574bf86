"""What a child shows while it runs and leaves when it ends, read and logged once; shared by the
runner and :func:`reclaim` (the attempt in flight when the supervisor itself died)."""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Sequence
from pathlib import Path

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.diagnosis.classify import first_failure
from qlora_supervise.supervisor.loop import child as child_mod
from qlora_supervise.supervisor.loop.child import Seams
from qlora_supervise.supervisor.loop.outcome import AttemptOutcome
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.journal import AttemptRecord, InFlight
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.watching import watch
from qlora_supervise.supervisor.watching.watch import HeartbeatReader, Progress, Watched
from qlora_supervise.trainer_child.contract import checkpoints
from qlora_supervise.trainer_child.contract.disk_space import is_disk_full
from qlora_supervise.trainer_child.contract.events import ChildEvent, Heartbeat, Resumed, Started, read_events
from qlora_supervise.trainer_child.contract.processes import pid_alive
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, Knobs, rank_files


def note_child_events(new: Sequence[ChildEvent], log: FilteringBoundLogger) -> None:
    """Log what the child reports once and a person wants to see at once: the rank cut on resume."""
    for event in new:
        if isinstance(event, Resumed) and event.rank_reduction is not None:
            log.info(
                Event.RANK_REDUCED,
                **dataclasses.asdict(event.rank_reduction),
                from_step=event.from_step,
                why="the smaller adapter starts from the truncated SVD of the trained update",
            )


@dataclasses.dataclass
class FirstStep:
    """Logs ``first_step`` once: the attempt's first completed optimizer step, timed from its
    start and from the previous attempt's failure (what a recovery costs, spare or not)."""

    resumed_from: int
    started_at: float  # wall clock
    failed_at: float | None
    warm_spare: bool
    seen: bool = False

    def note(self, events: Sequence[ChildEvent], log: FilteringBoundLogger) -> bool:
        """Log ``first_step`` if ``events`` hold it; True when they did."""
        for event in () if self.seen else events:
            if isinstance(event, Heartbeat) and event.step > self.resumed_from and event.time is not None:
                self.seen, at = True, event.time
                log.info(
                    Event.FIRST_STEP,
                    step=event.step,
                    warm_spare=self.warm_spare,
                    since_spawn_s=round(at - self.started_at, 2),
                    **({} if self.failed_at is None else {"since_failure_s": round(at - self.failed_at, 2)}),
                )
                return True
        return False


def note_rank_exits(spec: AttemptSpec, watched: Watched, now: float) -> None:
    """When each rank's process (its pid from its ``started`` event) was first seen gone."""
    if spec.knobs.world_size <= 1:
        return
    for rank, path in rank_files(spec.events_file):
        if rank not in watched.rank_pids:  # read until found: a rank's file is short at its start
            started = [e for e in read_events(Path(path)) if isinstance(e, Started) and e.pid]
            if started and started[-1].pid is not None:
                watched.rank_pids[rank] = started[-1].pid
    # A dead rank is torchrun's zombie until torchrun reaps it: pid_alive counts it as exited.
    for rank, pid in watched.rank_pids.items():
        if rank not in watched.rank_exits and not pid_alive(pid):
            watched.rank_exits[rank] = now


def ranks_overstay(
    spec: AttemptSpec, watched: Watched, now: float, bound_s: float, log: FilteringBoundLogger
) -> bool:
    """Once a rank has reported a failure the others get ``bound_s`` to leave, then are stopped as a
    hang is (an NCCL rank stuck in the broken collective would hold torchrun its whole shutdown timeout)."""
    if spec.knobs.world_size <= 1:
        return False
    if watched.rank_failed_at is None:
        watched.rank_failed_at = now if rank_files(spec.error_file) else None
        return False
    if now - watched.rank_failed_at < bound_s:
        return False
    log.warning(
        Event.RANKS_SHUTDOWN_BOUNDED,
        reported=[rank for rank, _ in rank_files(spec.error_file)],
        waited_s=round(now - watched.rank_failed_at, 1),
        why="a rank failed and the others did not leave: stopped with the hang grace",
    )
    return True


def card_fields(watched: Watched) -> dict[str, dict[str, int]]:
    """``child_exited``'s per-card numbers under torchrun: each local rank's card and its NVML peak."""
    if not watched.cards:
        return {}
    cards = {str(rank): index for rank, index in watched.cards.items()}
    return {"cards": cards, "card_peaks": {str(rank): peak for rank, peak in watched.card_peaks.items()}}


def note_rank_peaks(spec: AttemptSpec, progress: Progress, log: FilteringBoundLogger) -> dict[int, int]:
    """Each rank's peak (torchrun; {} for one process): the attempt's peak becomes the highest of
    them (the card that limits the config), and one rank well above the others is logged."""
    if spec.knobs.world_size <= 1:
        return {}
    if peaks := watch.read_rank_peaks(Path(spec.events_file)):
        progress.peak_bytes = max(progress.peak_bytes or 0, *peaks.values())
    if (found := watch.uneven(peaks)) is not None:
        log.warning(
            Event.RANK_PEAKS_UNEVEN,
            high_rank=found.high_rank,
            high_peak_bytes=found.high_bytes,
            low_rank=found.low_rank,
            low_peak_bytes=found.low_bytes,
            share_above=round(found.share_above, 3),
            rank_peaks={str(rank): peak for rank, peak in peaks.items()},
            why="one rank's peak is well above the others': uneven per-rank batches (long samples on one "
            "rank) or gradient-sync buffers; check each rank's real batch and the device_map",
        )
    return peaks


def seal_rank_parts(
    checkpoints_dir: Path, reports: Sequence[ErrorReport], knobs: Knobs, log: FilteringBoundLogger
) -> tuple[ErrorReport, ...]:
    """Under torchrun: ``checkpoint-N`` sealed from the ranks' emergency parts (rank 0's part and
    every rank's RNG state) when every rank's part names the same step; the reports then name it
    as their emergency checkpoint, else none (no part is trusted, and every part is removed)."""
    if not (parts := {r.rank: Path(r.emergency_checkpoint) for r in reports if r.emergency_checkpoint}):
        return tuple(reports)
    step = checkpoints.agreed_parts(list(parts.values()), knobs.world_size)
    sealed = None
    try:
        sealed = _seal(checkpoints_dir, parts, step, knobs) if step is not None and 0 in parts else None
    except OSError as exc:  # a part gone or unreadable: untrusted, like a missing one
        if is_disk_full(exc):
            raise  # the arbiter waits for room and reclaims the attempt
    if sealed is None:
        log.warning(
            Event.RANK_PARTS_UNTRUSTED,
            parts={str(rank): checkpoints.part_step(part) for rank, part in sorted(parts.items())},
            world_size=knobs.world_size,
            why="an emergency checkpoint needs every rank's part of the same step: the last regular "
            "checkpoint serves",
        )
    else:
        log.info(Event.RANK_PARTS_SEALED, step=step, path=str(sealed), ranks=sorted(parts))
    for parent in {part.parent for part in parts.values()}:
        shutil.rmtree(parent, ignore_errors=True)
    found, step_of = (str(sealed), step) if sealed is not None else (None, None)
    return tuple(dataclasses.replace(r, emergency_checkpoint=found, emergency_step=step_of) for r in reports)


def _seal(checkpoints_dir: Path, parts: dict[int, Path], step: int, knobs: Knobs) -> Path:
    final = checkpoints_dir / f"{checkpoints.CHECKPOINT_PREFIX}{step}"
    if checkpoints.is_complete(final):
        return final
    for rank, part in parts.items():
        if rank != 0:
            name = checkpoints.RNG_FILE.format(rank=rank)
            shutil.copy2(part / name, parts[0] / name)
    return checkpoints.publish(parts[0], final, step=step, knobs=knobs, emergency=True)


def ended(
    rd: RunDir, flight: InFlight, plan: Plan, progress: Progress, ended_at: float, log: FilteringBoundLogger
) -> AttemptOutcome:
    """An ended attempt as its files show it: every rank's report read (in rank order; an unreadable
    one is logged and left out), their emergency parts sealed."""
    found = []
    for _, path in rank_files(str(rd.attempt(flight.number).error)):
        try:
            found.append(ErrorReport.from_json(Path(path).read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError) as exc:
            log.warning(Event.REPORT_UNREADABLE, path=path, error=str(exc))
    reports = tuple(found)
    if torchrun := plan.knobs.world_size > 1:
        reports = seal_rank_parts(rd.checkpoints, reports, plan.knobs, log)
    cause = first_failure(reports)  # the one report that speaks for the attempt
    return AttemptOutcome(
        number=flight.number,
        plan=plan,
        exit=None,
        progress=progress,
        report=cause.report if cause is not None else (reports[0] if reports else None),
        reports=reports if torchrun else (),
        memory=Watched(progress),
        resumed_from=flight.resumed_from,
        started_at=flight.started_at,
        ended_at=ended_at,
        log_tail=child_mod.log_tail(rd.attempt(flight.number).log),
    )


def reclaim(
    flight: InFlight, records: Sequence[AttemptRecord], rd: RunDir, seams: Seams, log: FilteringBoundLogger
) -> AttemptOutcome | None:
    """What the in-flight attempt left; None when the journal already holds its record."""
    if any(r.attempt == flight.number for r in records):
        return None  # its record was written; only state.json was stale
    # PDEATHSIG normally ended the child already; the cmdline check keeps a reused pid safe and
    # finds a child whose pid was never recorded, torchrun's ranks, and a warm spare.
    for pid in child_mod.attempt_children(flight.pid, rd.attempt(flight.number).spec, rd):
        log.warning(Event.ORPHAN_CHILD_STOPPING, attempt=flight.number, pid=pid)
        child_mod.stop_group(pid, seams.stop_grace_s)
    reader = HeartbeatReader(rd.attempt(flight.number).events)
    reader.poll(seams.clock())
    return ended(rd, flight, Plan(flight.phase, flight.knobs), reader.progress, seams.wall(), log)
