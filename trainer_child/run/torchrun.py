"""This process as one of torchrun's ranks (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``): its events and error
files, its GPU, what the ranks agree on (DDP is the Trainer's; torch imported where used). A GPU asked for
and missing is a config error (not days on the CPU); ``auto`` may fall back to the CPU, saying why."""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Mapping
from typing import Any

from qlora_supervise.trainer_child.contract.spec import AttemptSpec, rank_file
from qlora_supervise.trainer_child.run import failure, memory
from qlora_supervise.trainer_child.run.heartbeat import Progress

#: Injected faults for tests: ``RANK:BYTES`` gives rank RANK alone the CPU or GPU cap BYTES (after
#: ``memory.TEST_CAP_AFTER_STEP`` when that is set), so one rank runs out of memory for real.
TEST_RANK_CPU_CAP = "QLORA_SUPERVISE_TEST_RANK_CPU_CAP"
TEST_RANK_GPU_CAP = "QLORA_SUPERVISE_TEST_RANK_GPU_CAP"


@dataclasses.dataclass(frozen=True)
class RankPlace:
    """Where this process sits among the ranks (a single process: rank 0 of 1)."""

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
    defaults = {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1}
    values = {name: environ.get(name, "") for name in defaults}
    return RankPlace(*(int(value) if value.isdigit() else defaults[name] for name, value in values.items()))


def rank_spec(spec: AttemptSpec, place: RankPlace, environ: Mapping[str, str] = os.environ) -> AttemptSpec:
    """The spec as this rank runs it: its own events and error files, and the injected caps naming it."""
    cpu = injected_cap(TEST_RANK_CPU_CAP, place, environ)
    gpu = None if memory.late_cap_step() is not None else injected_cap(TEST_RANK_GPU_CAP, place, environ)
    return dataclasses.replace(
        spec,
        events_file=rank_file(spec.events_file, place.rank),
        error_file=rank_file(spec.error_file, place.rank),
        cpu_memory_limit=spec.cpu_memory_limit if cpu is None else cpu,
        gpu_memory_limit=spec.gpu_memory_limit if gpu is None else gpu,
    )


def injected_cap(variable: str, place: RankPlace, environ: Mapping[str, str] = os.environ) -> int | None:
    target, _, cap = environ.get(variable, "").partition(":")
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
    """The pid naming a checkpoint's staging directory, the same on every rank: the launcher (every
    rank's parent) outlives them, so a staging dir whose owner is gone is a dead attempt's leftover."""
    return os.getppid() if place.distributed else os.getpid()


def _group(place: RankPlace) -> Any:
    if not place.distributed:
        return None
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def barrier(place: RankPlace) -> None:
    if (dist := _group(place)) is not None:
        dist.barrier()


def decide_together(place: RankPlace, progress: Progress, device: Any) -> tuple[bool, bool]:
    """Whether every rank stops / checkpoints after this step, true if any rank says so (MAX all-reduce):
    one that saves or stops alone would hang the others in mismatched collectives. Flags are only raised
    here, never cleared: a SIGTERM landing after this rank's value was sent counts in the next step's."""
    stop, early = progress.stop_requested, progress.early_checkpoints
    if (dist := _group(place)) is not None:
        import torch

        values = torch.tensor([int(stop), int(early)], dtype=torch.int32, device=device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
        stop, early = (bool(value) for value in values.tolist())
    progress.stop_requested = progress.stop_requested or stop
    progress.early_checkpoints = progress.early_checkpoints or early
    return stop, early


def check_device(spec: AttemptSpec, on_cuda: bool) -> str | None:
    """ConfigError for an unusable GPU asked for; else why ``auto`` (or a GPU cap) runs on CPU, or None."""
    if on_cuda:
        return None
    if spec.device not in ("auto", "cpu"):
        raise failure.ConfigError(
            f"resources.gpu {spec.device!r}: no usable GPU: {why_no_cuda()}. "
            "Fix the GPU setup, or set gpu: cpu (or auto) to train on the CPU"
        )
    notes = []
    if spec.device == "auto":
        notes.append(f"gpu: auto found no usable GPU ({why_no_cuda()}): training on the CPU")
    if spec.gpu_memory_limit is not None:
        notes.append("gpu_memory_limit does nothing on the CPU (cpu_memory_limit caps host memory)")
    if note := "; ".join(notes):
        print(f"trainer child: warning: {note}", file=sys.stderr, flush=True)
    return note or None


def why_no_cuda() -> str:
    import torch

    if torch.version.cuda is None:
        return f"torch {torch.__version__} is built without CUDA"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    try:
        import pynvml
    except ImportError as exc:
        return f"no NVIDIA driver could be asked (pynvml is not installed: {exc})"
    try:
        pynvml.nvmlInit()
        count = int(pynvml.nvmlDeviceGetCount())
        pynvml.nvmlShutdown()
    except pynvml.NVMLError as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
        return f"no NVIDIA driver could be loaded ({type(exc).__name__}: {exc})"
    if count == 0:
        return "the NVIDIA driver sees no GPU"
    return (
        f"CUDA_VISIBLE_DEVICES={visible!r} names no GPU CUDA can use (the driver sees {count}): no such index"
    )


def use_rank_gpu(place: RankPlace) -> None:
    """Make ``cuda:LOCAL_RANK`` current before anything allocates: caps, load and numbers mean it."""
    import torch

    if place.local_rank >= torch.cuda.device_count():
        raise failure.ConfigError(
            f"rank {place.rank} (local rank {place.local_rank}) has no GPU: {torch.cuda.device_count()} "
            "visible; lower resources.nproc_per_node or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    torch.cuda.set_device(place.local_rank)
