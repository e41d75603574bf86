"""Which checkpoint an attempt resumes from, judged from the checkpoint itself.

Each complete checkpoint's marker records the knobs it was trained with. A checkpoint of
another model, or of a smaller LoRA rank than the knobs (or the same rank with another alpha),
cannot be loaded and is skipped. One of a larger rank of the same model is loaded: the child
cuts its adapter to the knobs' rank by truncated SVD (``trainer_child.rank``), without its
optimizer state, whose shapes no longer fit. One written with another optimizer is loaded
without its optimizer state. Deciding from the
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


@dataclass(frozen=True)
class ResumePoint:
    step: int
    path: Path | None
    reset_optimizer: bool
    skipped: tuple[str, ...] = ()  # checkpoints passed over, with why
    rank_from: int | None = None  # the child cuts the adapter from this larger rank to the knobs'


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
        why_not = _unloadable(saved, knobs)
        if why_not is not None:
            skipped.append(f"{path.name}: {why_not}")
            continue
        rank_from = _larger_rank(saved, knobs)
        reset = rank_from is not None or saved.get("optimizer") != knobs.optimizer
        return ResumePoint(step, path, reset, tuple(skipped), rank_from)
    return ResumePoint(0, None, False, tuple(skipped))


def _unloadable(saved: dict[str, Any], knobs: Knobs) -> str | None:
    """Why an adapter saved with ``saved`` knobs cannot start ``knobs``; None when it can."""
    if _larger_rank(saved, knobs) is not None:
        differs = []  # cut down by SVD, its alpha rescaled with it: only the model must match
    else:
        differs = [name for name in ("lora_r", "lora_alpha") if saved.get(name) != getattr(knobs, name)]
    if saved.get("model") != knobs.model:
        differs.insert(0, "model")
    return f"adapter differs in {', '.join(differs)}" if differs else None


def _larger_rank(saved: dict[str, Any], knobs: Knobs) -> int | None:
    rank = saved.get("lora_r")
    if isinstance(rank, int) and not isinstance(rank, bool) and rank > knobs.lora_r:
        return rank
    return None


def _marker_knobs(path: Path) -> dict[str, Any] | None:
    try:
        marker = json.loads((path / CHECKPOINT_COMPLETE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(marker, dict):
        return None
    knobs = marker.get("knobs", {})
    return knobs if isinstance(knobs, dict) else None
