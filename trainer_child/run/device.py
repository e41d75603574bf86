"""Whether the device the job asks for is there: a GPU asked for and missing is a config error (not
days on the CPU); ``auto`` may fall back to the CPU, and ``started`` and stderr say why."""

from __future__ import annotations

import os
import sys

from qlora_supervise.trainer_child.contract.spec import AttemptSpec
from qlora_supervise.trainer_child.run.failure import ConfigError
from qlora_supervise.trainer_child.run.torchrun import RankPlace


def check(spec: AttemptSpec, on_cuda: bool) -> str | None:
    """Raise ConfigError when the spec's GPU is not usable; return why an ``auto`` job (or a GPU cap)
    runs on the CPU, or None."""
    if on_cuda:
        return None
    if spec.device not in ("auto", "cpu"):
        raise ConfigError(
            f"resources.gpu {spec.device!r}: no usable GPU: {why_no_cuda()}. "
            "Fix the GPU setup, or set gpu: cpu (or auto) to train on the CPU"
        )
    notes = []
    if spec.device == "auto":
        notes.append(f"gpu: auto found no usable GPU ({why_no_cuda()}): training on the CPU")
    if spec.gpu_memory_limit is not None:
        notes.append("gpu_memory_limit does nothing on the CPU (cpu_memory_limit caps host memory)")
    if not notes:
        return None
    note = "; ".join(notes)
    print(f"trainer child: warning: {note}", file=sys.stderr, flush=True)
    return note


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
        raise ConfigError(
            f"rank {place.rank} (local rank {place.local_rank}) has no GPU: {torch.cuda.device_count()} "
            "visible; lower resources.nproc_per_node or make more GPUs visible (CUDA_VISIBLE_DEVICES)"
        )
    torch.cuda.set_device(place.local_rank)
