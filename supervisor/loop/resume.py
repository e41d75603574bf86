"""Which checkpoint an attempt resumes from, judged from the checkpoint itself.

Each complete checkpoint's marker records the knobs it was trained with. A checkpoint whose
adapter has another shape (model, LoRA rank or alpha) cannot be loaded and is skipped; one
written with another optimizer is loaded without its optimizer state. Deciding from the
marker, not from the decision that led here, stays right however many attempts in between
failed, stopped or were interrupted before writing a checkpoint of their own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlora_supervise.trainer_child.checkpoint_dirs import CHECKPOINT_COMPLETE_MARKER, complete_checkpoints
from qlora_supervise.trainer_child.protocol import Knobs

_ADAPTER_SHAPE = ("model", "lora_r", "lora_alpha")


@dataclass(frozen=True)
class ResumePoint:
    step: int
    path: Path | None
    reset_optimizer: bool
    skipped: tuple[str, ...] = ()  # checkpoints passed over, with why


def resume_point(checkpoints_dir: Path, knobs: Knobs) -> ResumePoint:
    """The newest complete checkpoint these knobs can load (step 0 and no path: none)."""
    skipped: list[str] = []
    for step, path in reversed(complete_checkpoints(checkpoints_dir)):
        saved = _marker_knobs(path)
        if saved is None:
            skipped.append(f"{path.name}: unreadable marker")
            continue
        if not saved:  # a marker without knobs (written by hand or another tool): trust its shape
            return ResumePoint(step, path, False, tuple(skipped))
        differs = [name for name in _ADAPTER_SHAPE if saved.get(name) != getattr(knobs, name)]
        if differs:
            skipped.append(f"{path.name}: adapter differs in {', '.join(differs)}")
            continue
        reset = saved.get("optimizer") != knobs.optimizer
        return ResumePoint(step, path, reset, tuple(skipped))
    return ResumePoint(0, None, False, tuple(skipped))


def _marker_knobs(path: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((path / CHECKPOINT_COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict):
        return None
    knobs = marker.get("knobs", {})
    return knobs if isinstance(knobs, dict) else None
