"""This rank's part of an emergency checkpoint under torchrun (DDP), written with no collective.

After one rank's failure the others are dead or stuck in the collective it broke, so the
Trainer's own save (barriers, broadcasts) cannot run; :mod:`...contract.checkpoints` says how the
parts are laid out and when the supervisor trusts them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from qlora_supervise.trainer_child.contract import checkpoints
from qlora_supervise.trainer_child.contract.checkpoints import CHECKPOINT_PREFIX
from qlora_supervise.trainer_child.contract.disk_space import ensure_room
from qlora_supervise.trainer_child.recipe.trainer import SupervisedTrainerMixin
from qlora_supervise.trainer_child.run.torchrun import staging_owner


def save_rank_part(trainer: SupervisedTrainerMixin) -> Path | None:
    """Step N's part of this rank: rank 0 the adapter, optimizer, scheduler and trainer state (every
    rank holds the same under DDP), each rank its RNG state, then the part's marker naming step N."""
    step, place, directory = trainer.state.global_step, trainer.place, trainer.plan.directory
    if step <= 0 or checkpoints.is_complete(directory / f"{CHECKPOINT_PREFIX}{step}"):
        return None  # nothing learnt yet, or step N's regular checkpoint is already sealed
    trainer.drop_step_in_flight()
    part = checkpoints.part_dir(directory, step, staging_owner(place), place.rank)
    shutil.rmtree(part, ignore_errors=True)
    part.mkdir(parents=True)
    if place.is_main:
        ensure_room(directory)
        trainer._save(str(part))  # what the Trainer's own checkpoint writes of the model (no collective)
        trainer._save_optimizer_and_scheduler(str(part))
        trainer.state.save_to_json(str(part / "trainer_state.json"))
    trainer._save_rng_state(str(part))
    done = {"step": step, "rank": place.rank, "world_size": place.world_size}
    (part / checkpoints.PART_DONE).write_text(json.dumps(done), encoding="utf-8")
    return part
