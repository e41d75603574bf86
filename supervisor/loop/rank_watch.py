"""What the runner watches of a torchrun attempt beyond one process: when each rank's process left,
the ranks that outstay another rank's failure, and each rank's card in the ``child_exited`` line."""

from __future__ import annotations

from pathlib import Path

import psutil
from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.watching.watch import Watched
from qlora_supervise.trainer_child.contract.events import Started, read_events
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, rank_files


def note_rank_exits(spec: AttemptSpec, watched: Watched, now: float) -> None:
    """When each rank's process (its pid from its ``started`` event) was first seen gone: with no
    report that says otherwise, the rank that left first is the one that failed (a SIGKILL, while
    the others were stopped before they could report)."""
    if spec.knobs.world_size <= 1:
        return
    for rank, path in rank_files(spec.events_file):
        if rank not in watched.rank_pids:  # read until found: a rank's file is short at its start
            started = [e for e in read_events(Path(path)) if isinstance(e, Started) and e.pid]
            if started and started[-1].pid is not None:
                watched.rank_pids[rank] = started[-1].pid
    for rank, pid in watched.rank_pids.items():
        if rank not in watched.rank_exits and _gone(pid):
            watched.rank_exits[rank] = now


def _gone(pid: int) -> bool:
    # A rank is torchrun's child: until torchrun reaps it, a dead rank is a zombie.
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:  # not ours to look at: taken as alive
        return False


def ranks_overstay(
    spec: AttemptSpec, watched: Watched, now: float, bound_s: float, log: FilteringBoundLogger
) -> bool:
    """Once a rank has reported a failure the others get ``bound_s`` to leave (a gloo rank leaves at
    once; an NCCL rank stuck in the collective the failure broke does not, and torchrun would wait
    its whole shutdown timeout, the stop grace): then they are to be stopped, as a hang is."""
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
    """``child_exited``'s per-card numbers under torchrun: each local rank's card (NVML index) and
    the child's peak NVML saw there (the allocator's ``rank_peaks`` leave out the CUDA context)."""
    if not watched.cards:
        return {}
    cards = {str(rank): index for rank, index in watched.cards.items()}
    return {"cards": cards, "card_peaks": {str(rank): peak for rank, peak in watched.card_peaks.items()}}
