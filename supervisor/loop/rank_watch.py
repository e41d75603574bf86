"""What the runner watches of a torchrun attempt beyond one process: the ranks that outstay another
rank's failure, and each rank's card in the ``child_exited`` line."""

from __future__ import annotations

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.watching.watch import Watched
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, rank_files


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
