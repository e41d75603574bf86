"""This process as one of torchrun's ranks: where it sits, its own files, and what ranks agree on.

torchrun (started by ``supervisor/loop/launch.py``) says where a rank is through ``RANK``,
``LOCAL_RANK`` and ``WORLD_SIZE``. Each rank writes its own events and error report
(:func:`contract.spec.rank_file`); rank 0 alone writes checkpoints and the adapter. DDP itself is
the Trainer's (accelerate). Standard library at import; torch only where the process group is used.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from qlora_supervise.trainer_child.contract.spec import AttemptSpec, rank_file
from qlora_supervise.trainer_child.run.heartbeat import Progress
from qlora_supervise.trainer_child.run.memory import late_cap_step

#: Injected faults for tests and benches, never set elsewhere: ``RANK:BYTES`` gives rank RANK alone
#: the CPU cap (RLIMIT_DATA) or the GPU cap BYTES, after ``memory.TEST_CAP_AFTER_STEP`` when that
#: is set (until then the job's own caps hold), so one rank of several runs out of memory for real,
#: mid-run, while the others have room.
TEST_RANK_CPU_CAP = "QLORA_SUPERVISE_TEST_RANK_CPU_CAP"
TEST_RANK_GPU_CAP = "QLORA_SUPERVISE_TEST_RANK_GPU_CAP"


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where this process sits among the ranks (a single process is rank 0 of 1)."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


SINGLE = RankPlace()


def this_rank(environ: Mapping[str, str] = os.environ) -> RankPlace:
    """The place torchrun's environment gives this process; rank 0 of 1 outside torchrun."""
    rank, local, world = (environ.get(name, "") for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    return RankPlace(
        int(rank) if rank.isdigit() else 0,
        int(local) if local.isdigit() else 0,
        int(world) if world.isdigit() else 1,
    )


def rank_spec(spec: AttemptSpec, place: RankPlace, environ: Mapping[str, str] = os.environ) -> AttemptSpec:
    """The spec as this rank runs it: its own events and error files, and the injected caps
    (:data:`TEST_RANK_CPU_CAP`, :data:`TEST_RANK_GPU_CAP`) that name this rank."""
    cpu = _injected_cap(environ.get(TEST_RANK_CPU_CAP, ""), place)
    gpu = None if late_cap_step() is not None else injected_gpu_cap(place, environ)
    return dataclasses.replace(
        spec,
        events_file=rank_file(spec.events_file, place.rank),
        error_file=rank_file(spec.error_file, place.rank),
        cpu_memory_limit=spec.cpu_memory_limit if cpu is None else cpu,
        gpu_memory_limit=spec.gpu_memory_limit if gpu is None else gpu,
    )


def injected_gpu_cap(place: RankPlace, environ: Mapping[str, str] = os.environ) -> int | None:
    """This rank's injected GPU cap (:data:`TEST_RANK_GPU_CAP`), or None."""
    return _injected_cap(environ.get(TEST_RANK_GPU_CAP, ""), place)


def _injected_cap(value: str, place: RankPlace) -> int | None:
    target, _, cap = value.partition(":")
    return int(cap) if target.isdigit() and int(target) == place.rank and cap.isdigit() else None


def world_mismatch(spec: AttemptSpec, place: RankPlace) -> str | None:
    """Why this process cannot run ``spec`` (started with another number of ranks), or None."""
    if spec.knobs.world_size == place.world_size:
        return None
    return (
        f"the spec asks for world_size {spec.knobs.world_size} but this process is rank {place.rank} of "
        f"{place.world_size}: start it through torchrun with --nproc-per-node {spec.knobs.world_size} "
        "(the supervisor does this from resources.nproc_per_node)"
    )


def staging_owner(place: RankPlace) -> int:
    """The pid that names a checkpoint's staging directory, the same on every rank of a host: the
    launcher (every rank's parent) lives as long as any rank, so a staging directory whose owner
    is gone is a dead attempt's leftover."""
    return os.getppid() if place.distributed else os.getpid()


def _group(place: RankPlace) -> Any:
    """``torch.distributed`` when this process is one of several ranks of a live group, else None."""
    if not place.distributed:
        return None
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def barrier(place: RankPlace) -> None:
    """Wait for every rank (no-op for a single process)."""
    dist = _group(place)
    if dist is not None:
        dist.barrier()


def agree(place: RankPlace, flags: tuple[bool, ...], device: Any) -> tuple[bool, ...]:
    """Each flag true on any rank becomes true on all (a MAX all-reduce; as given when single).

    SIGTERM and the early-checkpoint signal reach the ranks at different moments; a rank that
    saves or stops while another trains into the next step would hang both in mismatched
    collectives, so the ranks decide together at every step's end.
    """
    dist = _group(place)
    if dist is None:
        return flags
    import torch

    values = torch.tensor([int(flag) for flag in flags], dtype=torch.int32, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return tuple(bool(value) for value in values.tolist())


def decide_together(place: RankPlace, progress: Progress, device: Any) -> tuple[bool, bool]:
    """Whether every rank stops and checkpoints after this step: (stop, early checkpoint).

    The flags are only ever raised here, never cleared: a SIGTERM that lands while this rank waits
    in the all-reduce runs its handler after the value was sent. Assigning the agreed value back
    would drop it, and every rank would train on until the launcher's SIGKILL; kept, it goes into
    the next step's all-reduce.
    """
    stop, early = agree(place, (progress.stop_requested, progress.early_checkpoints), device)
    progress.stop_requested = progress.stop_requested or stop
    progress.early_checkpoints = progress.early_checkpoints or early
    return stop, early
