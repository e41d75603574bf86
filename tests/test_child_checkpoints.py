"""Checkpoint directories are complete or invisible, and rotation spares the resume source."""

from __future__ import annotations

from pathlib import Path

from qlora_supervise.trainer_child.contract import checkpoints
from qlora_supervise.trainer_child.contract.checkpoints import (
    CHECKPOINT_COMPLETE_MARKER,
    complete_checkpoints,
)
from qlora_supervise.trainer_child.contract.spec import Knobs


def _written(root: Path, step: int) -> Path:
    staging = checkpoints.staging_dir(root, step) / f"checkpoint-{step}"
    staging.mkdir(parents=True)
    (staging / "adapter_model.safetensors").write_bytes(b"x" * 10)
    (staging / "optimizer.pt").write_bytes(b"o")
    return staging


def test_publish_renames_a_sealed_directory(tmp_path: Path) -> None:
    """A written temp checkpoint is invisible until publish seals it with the marker and renames it."""
    written = _written(tmp_path, 5)
    assert complete_checkpoints(tmp_path) == []
    final = checkpoints.publish(
        written, tmp_path / "checkpoint-5", step=5, knobs=Knobs(model="m"), emergency=True
    )
    assert (final / CHECKPOINT_COMPLETE_MARKER).is_file()
    assert complete_checkpoints(tmp_path) == [(5, final)]


def test_rotate_keeps_newest_and_the_resume_source(tmp_path: Path) -> None:
    """Rotation keeps the newest checkpoints and never deletes the one the attempt resumed from."""
    for step in (2, 4, 6, 8):
        checkpoints.publish(
            _written(tmp_path, step),
            tmp_path / f"checkpoint-{step}",
            step=step,
            knobs=Knobs(model="m"),
            emergency=False,
        )
    checkpoints.rotate(tmp_path, keep=2, protect=tmp_path / "checkpoint-2")
    assert [step for step, _ in complete_checkpoints(tmp_path)] == [2, 6, 8]


def test_stale_temps_of_dead_children_are_removed(tmp_path: Path) -> None:
    """Temp directories whose writer pid is gone are deleted; a live writer's are kept."""
    dead = tmp_path / ".tmp-checkpoint-3-999999999"
    dead.mkdir()
    live = checkpoints.staging_dir(tmp_path, 4)
    live.mkdir()
    checkpoints.remove_stale_temps(tmp_path)
    assert not dead.exists() and live.exists()


def test_without_optimizer_keeps_everything_else(tmp_path: Path) -> None:
    """The reset-optimizer copy drops optimizer state and keeps adapter and the rest."""
    source = tmp_path / "checkpoint-1"
    source.mkdir()
    for name in ("adapter_model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"):
        (source / name).write_text(name)
    copy = checkpoints.without_optimizer(source, tmp_path / ".tmp-reset-1")
    assert sorted(p.name for p in copy.iterdir()) == [
        "adapter_model.safetensors",
        "scheduler.pt",
        "trainer_state.json",
    ]
