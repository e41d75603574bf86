"""This process as one of torchrun's ranks: where it sits, its own files, and what ranks agree on.

The supervisor starts ``resources.nproc_per_node`` ranks through ``python -m torch.distributed.run``
(``supervisor/loop/launch.py``); each runs this same child with the same spec. torchrun tells each
rank where it is through ``RANK``, ``LOCAL_RANK`` and ``WORLD_SIZE``. Each rank writes its own
events and error report (:func:`contract.spec.rank_file`); rank 0 alone writes checkpoints and the
adapter. DDP itself is the Trainer's (accelerate): gloo on the CPU, NCCL on GPUs, one GPU per rank
(``cuda:LOCAL_RANK``).

Standard library at import; torch only inside the functions that talk to the process group.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from typing import Any

from qlora_supervise.trainer_child.contract.spec import AttemptSpec, rank_file
from qlora_supervise.trainer_child.run.heartbeat import Progress

#: Injected fault for tests: ``RANK:BYTES`` gives rank RANK alone the CPU cap BYTES
#: (``RLIMIT_DATA``, in place of the spec's ``cpu_memory_limit``), so one rank of several runs out
#: of memory for real, inside torch, while the others have room. With
#: ``memory.TEST_CAP_AFTER_STEP`` the cap comes after that step. Never set outside tests.
TEST_RANK_CPU_CAP = "QLORA_SUPERVISE_TEST_RANK_CPU_CAP"
#: The same for the GPU: ``RANK:BYTES`` gives rank RANK alone ``gpu_memory_limit`` BYTES
#: (``set_per_process_memory_fraction`` on its card), for the bench of one capped card among two.
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


#: A single process: rank 0 of 1.
SINGLE = RankPlace()


def this_rank(environ: Mapping[str, str] = os.environ) -> RankPlace:
    """The place torchrun's environment gives this process; rank 0 of 1 outside torchrun."""

    def number(name: str, default: int) -> int:
        value = environ.get(name, "")
        return int(value) if value.isdigit() else default

    return RankPlace(number("RANK", 0), number("LOCAL_RANK", 0), number("WORLD_SIZE", 1))


def rank_spec(spec: AttemptSpec, place: RankPlace, environ: Mapping[str, str] = os.environ) -> AttemptSpec:
    """The spec as this rank runs it: its own events and error files, and the injected caps
    (:data:`TEST_RANK_CPU_CAP`, :data:`TEST_RANK_GPU_CAP`) that name this rank."""
    own = dataclasses.replace(
        spec,
        events_file=rank_file(spec.events_file, place.rank),
        error_file=rank_file(spec.error_file, place.rank),
    )
    cpu = _injected_cap(environ.get(TEST_RANK_CPU_CAP, ""), place)
    gpu = _injected_cap(environ.get(TEST_RANK_GPU_CAP, ""), place)
    return dataclasses.replace(
        own,
        cpu_memory_limit=own.cpu_memory_limit if cpu is None else cpu,
        gpu_memory_limit=own.gpu_memory_limit if gpu is None else gpu,
    )


def _injected_cap(value: str, place: RankPlace) -> int | None:
    """BYTES of a ``RANK:BYTES`` hook value that names this rank; None otherwise."""
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
    """The pid that names a checkpoint's staging directory, the same on every rank of a host.

    Every rank writes into one staging directory (rank N its RNG state, rank 0 the rest) before
    rank 0 seals it. The launcher (torchrun's agent, every rank's parent) lives as long as any
    rank, so a staging directory whose owner is gone is a dead attempt's leftover.
    """
    return os.getppid() if place.distributed else os.getpid()


def barrier(place: RankPlace) -> None:
    """Wait for every rank (no-op for a single process)."""
    if not place.distributed:
        return
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def agree(place: RankPlace, flags: tuple[bool, ...], device: Any) -> tuple[bool, ...]:
    """Each flag true on any rank becomes true on all (a MAX all-reduce; as given when single).

    SIGTERM and the early-checkpoint signal reach the ranks at different moments; a rank that
    saves or stops while another trains into the next step would hang both in mismatched
    collectives, so the ranks decide together at every step's end.
    """
    if not place.distributed:
        return flags
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return flags
    values = torch.tensor([int(flag) for flag in flags], dtype=torch.int32, device=device)
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return tuple(bool(value) for value in values.tolist())


def decide_together(place: RankPlace, progress: Progress, device: Any) -> tuple[bool, bool]:
    """Whether every rank stops and checkpoints after this step: (stop, early checkpoint).

    The signal flags are only ever raised here, never cleared. A SIGTERM that lands while this
    rank waits in the all-reduce runs its handler once the collective returns, after the value
    was sent: no rank saw it this step. Assigning the agreed value back to the flag would drop
    it on this rank, and every rank would train on until the launcher's SIGKILL. Kept, it goes
    into the next step's all-reduce, and the ranks act on the agreed value, together.
    """
    stop, early = agree(place, (progress.stop_requested, progress.early_checkpoints), device)
    progress.stop_requested = progress.stop_requested or stop
    progress.early_checkpoints = progress.early_checkpoints or early
    return stop, early
