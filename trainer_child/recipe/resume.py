"""Loading the resume checkpoint: its failures named as the checkpoint's, the optimizer state through
the host (the ``optimizer_state_on_host`` rung), the LR schedule of a reset or an extended run."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from qlora_supervise.trainer_child.contract import checkpoints
from qlora_supervise.trainer_child.run.failure import is_oom
from qlora_supervise.trainer_child.run.memory import MMAP_THRESHOLD, apply_cpu_cap, proc_status_bytes

if TYPE_CHECKING:
    from qlora_supervise.trainer_child.recipe.trainer import SupervisedTrainerMixin

#: Injected fault for tests: as the resume's optimizer state is read, cap the data segment at what is
#: in use plus half the state's file and ask for one more large copy (as Trainer's loader under
#: torchrun does on the card): the allocation fails for real, in the stage ``resume``.
TEST_CAP_IN_RESUME = "QLORA_SUPERVISE_TEST_CAP_IN_RESUME"


@contextlib.contextmanager
def checkpoint_load(checkpoint: str | None, what: str) -> Iterator[None]:
    """Any exception but an OOM (the host allocator's RuntimeError included) while loading ``what``
    becomes a CheckpointLoadError."""
    try:
        yield
    except Exception as exc:
        if is_oom(exc):
            raise
        raise checkpoints.CheckpointLoadError(
            f"{checkpoint}: cannot load its {what}: {type(exc).__name__}: {exc}"
        ) from exc


def load_through_host(trainer: SupervisedTrainerMixin, checkpoint: str | None) -> bool:
    """The ``optimizer_state_on_host`` rung: the state read into host memory, copied to the card
    tensor by tensor (Trainer under torchrun reads it onto the card whole). False: Trainer's own
    loader does it (knob off, no file, or DeepSpeed / FSDP, whose loaders are their own)."""
    if checkpoint is None or not trainer.plan.knobs.optimizer_state_on_host or trainer.optimizer is None:
        return False
    state_file = Path(checkpoint) / "optimizer.pt"
    if not state_file.is_file() or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        return False
    trainer.optimizer.load_state_dict(torch.load(state_file, map_location="cpu", weights_only=True))
    scheduler_file = Path(checkpoint) / "scheduler.pt"
    if trainer.lr_scheduler is not None and scheduler_file.is_file():
        trainer.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
    return True


def restore_scheduler(trainer: SupervisedTrainerMixin, checkpoint: Path) -> None:
    """The checkpoint's LR schedule when the optimizer state is reset (Trainer restores it only with the
    optimizer); a damaged file is a CheckpointLoadError."""
    path = checkpoint / "scheduler.pt"
    if trainer.lr_scheduler is None or trainer.optimizer is None or not path.is_file():
        return
    try:
        trainer.lr_scheduler.load_state_dict(torch.load(path, weights_only=True))
    except Exception as exc:
        raise checkpoints.CheckpointLoadError(f"{path}: {type(exc).__name__}: {exc}") from exc


def follow_schedule(trainer: SupervisedTrainerMixin, step: int) -> None:
    """The learning rate of ``step`` on *this* attempt's schedule, in the scheduler and the optimizer:
    a run extended (``max_steps`` raised) continues as one of the new length would, not at the old
    schedule's end (rate 0 for cosine); an ordinary resume gets the value it restored."""
    scheduler, optimizer = trainer.lr_scheduler, trainer.optimizer
    if scheduler is None or optimizer is None:
        return
    # LambdaLR (cosine, linear, constant, warmup) is a function of its step count alone; another
    # (reduce on plateau) keeps the state it restored.
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
