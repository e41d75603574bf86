"""The resume: loading its checkpoint (failures named as the checkpoint's, the optimizer state through
the host for the ``optimizer_state_on_host`` rung, the LR schedule of a reset or an extended run), and a
trained LoRA adapter cut to a smaller rank by truncated SVD, so halving the rank keeps progress.
Each module's update is ``delta_W = scale * B @ A``; with ``U S V^T = svd(delta_W)`` and new rank ``k``,
``B' = U_k sqrt(S_k / scale')`` and ``A' = sqrt(S_k / scale') V_k^T`` give the best rank-``k``
approximation (Eckart-Young). The SVD is of an ``r x r`` core (QR of ``B`` and ``A^T``), never of the
full ``out x in`` matrix. The optimizer state keeps the old shapes: the caller resets it."""

from __future__ import annotations

import contextlib
import json
import math
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

from qlora_supervise.trainer_child.contract import checkpoints
from qlora_supervise.trainer_child.contract.attempt_facts import RankReduction
from qlora_supervise.trainer_child.run.failure import ConfigError, is_oom
from qlora_supervise.trainer_child.run.memory import MMAP_THRESHOLD, apply_cpu_cap, proc_status_bytes

if TYPE_CHECKING:
    from transformers import Trainer

#: Injected fault for tests: as the resume's optimizer state is read, cap the data segment at what is
#: in use plus half the state's file and ask for one more large copy (as Trainer's loader under
#: torchrun does on the card): the allocation fails for real, in the stage ``resume``.
TEST_CAP_IN_RESUME = "QLORA_SUPERVISE_TEST_CAP_IN_RESUME"


@contextlib.contextmanager
def checkpoint_load(checkpoint: str | None, what: str) -> Iterator[None]:
    """Any exception but an OOM (a host allocator's RuntimeError too) loading ``what``: a load error."""
    try:
        yield
    except Exception as exc:
        if is_oom(exc):
            raise
        raise checkpoints.CheckpointLoadError(
            f"{checkpoint}: cannot load its {what}: {type(exc).__name__}: {exc}"
        ) from exc


def load_through_host(trainer: Trainer, on_host: bool, checkpoint: str | None) -> bool:
    """The ``optimizer_state_on_host`` rung: the state read into host memory, copied to the card
    tensor by tensor (Trainer under torchrun reads it onto the card whole). False: Trainer's own
    loader does it (knob off, no file, or DeepSpeed / FSDP, whose loaders are their own)."""
    if checkpoint is None or not on_host or trainer.optimizer is None:
        return False
    state_file = Path(checkpoint) / "optimizer.pt"
    if not state_file.is_file() or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        return False
    trainer.optimizer.load_state_dict(torch.load(state_file, map_location="cpu", weights_only=True))
    scheduler_file = Path(checkpoint) / "scheduler.pt"
    if trainer.lr_scheduler is not None and scheduler_file.is_file():
        trainer.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
    return True


def restore_scheduler(trainer: Trainer, checkpoint: Path) -> None:
    """The checkpoint's LR schedule when the optimizer state is reset (Trainer restores it only with the
    optimizer); a damaged file is a CheckpointLoadError."""
    path = checkpoint / "scheduler.pt"
    if trainer.lr_scheduler is None or trainer.optimizer is None or not path.is_file():
        return
    try:
        trainer.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
    except Exception as exc:
        raise checkpoints.CheckpointLoadError(f"{path}: {type(exc).__name__}: {exc}") from exc


def follow_schedule(trainer: Trainer, step: int) -> None:
    """The learning rate of ``step`` on *this* attempt's schedule, in the scheduler and the optimizer:
    a run extended (``max_steps`` raised) continues as one of the new length would, not at the old
    schedule's end (rate 0 for cosine); an ordinary resume gets the value it restored."""
    scheduler, optimizer = trainer.lr_scheduler, trainer.optimizer
    if scheduler is None or optimizer is None:
        return
    # LambdaLR (cosine, linear, constant, warmup) is a function of its step alone; plateau keeps its state.
    if isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        scheduler.last_epoch = step - 1
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "scheduler.step() before optimizer.step()": meant here
            scheduler.step()
    for group, lr in zip(optimizer.param_groups, scheduler.get_last_lr(), strict=False):
        group["lr"] = lr


def inject_resume_cap(checkpoint: str | None) -> None:
    """The injected fault of :data:`TEST_CAP_IN_RESUME` (nothing without it)."""
    state = Path(checkpoint) / "optimizer.pt" if checkpoint and os.environ.get(TEST_CAP_IN_RESUME) else None
    if state is not None and state.is_file():
        size = state.stat().st_size
        in_use = proc_status_bytes("VmData") or 0
        apply_cpu_cap(in_use + size // 2)
        # Twice the data segment: no free chunk of the heap can serve it, so the segment must grow
        # past the cap whatever glibc's free lists hold (a request of the state's size alone was
        # served from them under load, and the cap failed the next step's forward instead).
        torch.empty(max(size, 2 * in_use, 2 * MMAP_THRESHOLD), dtype=torch.uint8)


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_A, _B = ".lora_A.", ".lora_B."


def lora_scale(alpha: float, rank: int, rslora: bool = False) -> float:
    """peft's scaling of ``B @ A``."""
    return alpha / math.sqrt(rank) if rslora else alpha / rank


def truncate_pair(
    b: torch.Tensor, a: torch.Tensor, scale: float, rank: int, new_scale: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(B', A', s)``: ``new_scale * B' @ A'`` the best rank-``rank`` approximation of ``scale * b @ a``,
    and all singular values ``s`` of that update (descending); float64 inside, float32 out."""
    q_b, r_b = torch.linalg.qr(b.double())  # b = q_b r_b, q_b: out x r with orthonormal columns
    q_a, r_a = torch.linalg.qr(a.double().T)  # a^T = q_a r_a
    u_core, s, vh_core = torch.linalg.svd(scale * r_b @ r_a.T)
    u, vh = q_b @ u_core[:, :rank], vh_core[:rank] @ q_a.T
    root = torch.sqrt(s[:rank] / new_scale)
    return (u * root).float(), (root[:, None] * vh).float(), s.float()


def energy_share(singular: torch.Tensor, rank: int) -> float:
    """Share of ``sum(s^2)`` in the top ``rank`` values; 1.0 for a zero update (nothing to lose)."""
    energy = singular.double().square()
    total = float(energy.sum())
    return float(energy[:rank].sum()) / total if total > 0 else 1.0


def adapter_rank(directory: Path) -> int | None:
    """The rank ``r`` a saved adapter's config names; None without a readable config."""
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    rank = config.get("r") if isinstance(config, dict) else None
    return rank if isinstance(rank, int) else None


def truncate_adapter(directory: Path, rank: int, alpha: int) -> RankReduction:
    """Rewrite the adapter in ``directory`` (a scratch copy) at ``rank`` and ``alpha``; the energy kept."""
    config = json.loads((directory / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    # Per-module ranks or DoRA magnitudes would need their own rule; the recipe never writes them.
    if config.get("rank_pattern") or config.get("alpha_pattern") or config.get("use_dora"):
        raise ConfigError(
            f"resume_from {directory}: the adapter uses rank_pattern, alpha_pattern or DoRA, which "
            "rank reduction does not handle; resume it at its own lora_r or start from step 0"
        )
    rslora = bool(config.get("use_rslora"))
    old_rank, old_alpha = int(config["r"]), float(config["lora_alpha"])
    if rank > old_rank:
        raise ConfigError(f"resume_from {directory}: adapter rank {old_rank} is smaller than lora_r {rank}")
    weights = load_file(str(directory / ADAPTER_WEIGHTS))
    new_scale = lora_scale(alpha, rank, rslora)
    out: dict[str, torch.Tensor] = {}
    kept: dict[str, float] = {}
    total = top = 0.0
    for name, tensor in weights.items():
        if _A not in name:
            out.setdefault(name, tensor)  # B factors are written with their A; other keys as they are
            continue
        b_name = name.replace(_A, _B)
        b, a = weights[b_name], tensor
        old_scale = lora_scale(old_alpha, a.shape[0], rslora)
        b_new, a_new, singular = truncate_pair(b, a, old_scale, rank, new_scale)
        out[name], out[b_name] = a_new.to(a.dtype).contiguous(), b_new.to(b.dtype).contiguous()
        kept[name.split(_A)[0]] = energy_share(singular, rank)
        total += float(singular.double().square().sum())
        top += float(singular.double()[:rank].square().sum())
    if not kept:
        raise ConfigError(f"resume_from {directory}: {ADAPTER_WEIGHTS} holds no LoRA A/B factors")
    save_file(out, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config.update(r=rank, lora_alpha=alpha)
    (directory / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True), encoding="utf-8")
    worst = min(kept, key=kept.__getitem__)
    return RankReduction(old_rank, rank, len(kept), top / total if total > 0 else 1.0, kept[worst], worst)
