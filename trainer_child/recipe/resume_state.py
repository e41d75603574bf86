"""Loading the resume checkpoint's optimizer state (the stage ``resume``, issue 33).

:func:`load_through_host` is the ``optimizer_state_on_host`` rung; :func:`inject_resume_cap` the
injected fault the CPU tests use to make that load run out of memory for real.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from qlora_supervise.trainer_child.run.memory import MMAP_THRESHOLD, apply_cpu_cap, proc_status_bytes

#: Injected fault for tests: as the resume checkpoint's optimizer state is read, cap the data
#: segment at what is in use plus half the state's file and ask for one more large copy (as
#: Trainer's loader under torchrun reads the state onto the card whole before load_state_dict copies it):
#: the allocation fails for real, in the stage ``resume``. On the CPU a plain load never costs more
#: than the first step's fresh state, so without the extra copy no cap fails there and not later.
TEST_CAP_IN_RESUME = "QLORA_SUPERVISE_TEST_CAP_IN_RESUME"


def load_through_host(trainer: Any, checkpoint: str | None, on_host: bool) -> bool:
    """The ``optimizer_state_on_host`` rung: read the optimizer state into host memory and let
    ``load_state_dict`` copy it to the card tensor by tensor, where Trainer under torchrun reads it
    onto the card whole. False: Trainer's own loader does it (knob off, no file, or DeepSpeed /
    FSDP, whose loaders are their own)."""
    if checkpoint is None or not on_host or trainer.optimizer is None:
        return False
    state_file = Path(checkpoint) / "optimizer.pt"
    if not state_file.is_file() or trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled:
        return False
    state = torch.load(state_file, map_location="cpu", weights_only=True)
    trainer.optimizer.load_state_dict(state)
    del state
    scheduler_file = Path(checkpoint) / "scheduler.pt"
    if trainer.lr_scheduler is not None and scheduler_file.is_file():
        trainer.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))
    return True


def inject_resume_cap(checkpoint: str | None) -> None:
    """The injected fault of :data:`TEST_CAP_IN_RESUME` (nothing without it)."""
    state = Path(checkpoint) / "optimizer.pt" if checkpoint and os.environ.get(TEST_CAP_IN_RESUME) else None
    if state is not None and state.is_file():
        size = state.stat().st_size
        in_use = proc_status_bytes("VmData") or 0
        apply_cpu_cap(in_use + size // 2)
        # Twice the data segment: no free chunk of the heap can serve it (each lies inside the
        # segment), so the allocation must grow the segment past the cap whatever glibc's free lists
        # hold; a request of the state's size alone was served from them under load (-n 2), the load
        # passed, and the cap failed the next step's forward instead.
        torch.empty(max(size, 2 * in_use, 2 * MMAP_THRESHOLD), dtype=torch.uint8)
