"""The emergency checkpoint under torchrun (DDP): one part per rank, trusted only when all agree.

After one rank fails, the others are dead or stuck in the collective the failure broke, so no
save that needs every rank (a barrier, the Trainer's own) can run. Under DDP every rank holds
the same adapter, optimizer and scheduler state at step N (step N+1's optimizer step needs every
rank's gradients, so it ran on none), so each rank that can writes its *part* with no collective:
that state and its own RNG state, into ``.tmp-emergency-<step>-<launcher pid>/rank-<R>/``, ending
with :data:`PART_DONE` naming its step. The supervisor seals the checkpoint from rank 0's part
and every rank's RNG state only when all ``world_size`` parts name the same step
(:func:`agreed_parts`); otherwise none is trusted and the last regular checkpoint serves.
FSDP writes no parts (each rank holds only a shard: a save is a collective).
"""

from __future__ import annotations

import json
from pathlib import Path

from qlora_supervise.trainer_child.contract.checkpoints import TEMP_PREFIX

PART_DONE = "part.json"
#: The Trainer's per-rank RNG file (``Trainer._save_rng_state``: ``rng_state_<process_index>.pth``).
RNG_FILE = "rng_state_{rank}.pth"


def parts_dir(checkpoints_dir: Path, step: int, owner: int) -> Path:
    """Where the ranks of the launcher ``owner`` write their parts of step ``step`` (a stale temp
    once the launcher is gone, removed as the checkpoints' staging directories are)."""
    return checkpoints_dir / f"{TEMP_PREFIX}emergency-{step}-{owner}"


def part_dir(checkpoints_dir: Path, step: int, owner: int, rank: int) -> Path:
    return parts_dir(checkpoints_dir, step, owner) / f"rank-{rank}"


def part_step(part: Path) -> int | None:
    """The step a finished part names; None when it is unfinished or unreadable."""
    try:
        step = json.loads((part / PART_DONE).read_text(encoding="utf-8")).get("step")
    except (OSError, ValueError, AttributeError):
        return None
    return step if isinstance(step, int) else None


def agreed_parts(parts: list[Path], world_size: int) -> int | None:
    """The step every rank's part names, when there is one finished part per rank; else None."""
    steps = {part_step(part) for part in parts}
    if len(parts) != world_size or len(steps) != 1 or None in steps:
        return None
    return steps.pop()
