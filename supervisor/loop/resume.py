"""Which checkpoint an attempt resumes from, judged from the checkpoint itself.

Each complete checkpoint's marker records the knobs it was trained with and the size and
sha256 of each of its files. A checkpoint whose files no longer match (truncated, overwritten)
is skipped and, when the caller names a quarantine, moved there; one whose adapter has another
model, or a smaller LoRA rank than the knobs (or the same rank with another alpha), cannot be
loaded and is skipped; one of a larger rank of the same model is loaded and the child cuts its
adapter to the knobs' rank by truncated SVD (``trainer_child.rank``), without its optimizer
state, whose shapes no longer fit; one written with another optimizer, or before the
``fresh_optimizer_state`` rung, is loaded without its optimizer state. Deciding from the marker, not from the
decision that led here, stays right however many attempts in between failed, stopped or were
interrupted before writing a checkpoint of their own.

A checkpoint that passes (or whose older marker lists no files) and still fails to load in the
child comes back as a ``checkpoint_damaged`` failure: :func:`quarantine_reported` moves it aside
and the next attempt resumes from the next older one, with the config unchanged.

When a run ends, :func:`clean_staging` removes what killed writers left behind (staging
directories of checkpoints and of the adapter).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.trainer_child.contract.checkpoints import (
    OPTIMIZER_FILES,
    TEMP_PREFIX,
    complete_checkpoints,
    damaged_files,
    quarantine,
    read_marker,
    remove_stale_temps,
)
from qlora_supervise.trainer_child.contract.processes import pid_alive
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import Knobs


@dataclass(frozen=True)
class Quarantined:
    """A checkpoint moved out of the way: where it was, where it went, and why."""

    path: Path
    moved_to: Path
    why: str


@dataclass(frozen=True)
class ResumePoint:
    step: int
    path: Path | None
    reset_optimizer: bool
    skipped: tuple[str, ...] = ()  # checkpoints passed over, with why
    quarantined: tuple[Quarantined, ...] = ()
    rank_from: int | None = None  # the child cuts the adapter from this larger rank to the knobs'


def resume_point(checkpoints_dir: Path, knobs: Knobs, *, quarantine_damaged: bool = False) -> ResumePoint:
    """The newest complete, intact checkpoint these knobs can load (step 0 and no path: none).

    One loop over the checkpoints, newest first, each rule in the order of the module docstring
    (marker, files, adapter shape, optimizer): long only because each rule says why it skips.

    With ``quarantine_damaged`` a checkpoint whose files differ from its marker is moved to the
    quarantine folder (``checkpoints.QUARANTINE_DIR``); without it, it is only skipped (the
    arbiter's prediction of the next resume step reads the same rule and moves nothing).
    """
    skipped: list[str] = []
    moved: list[Quarantined] = []
    for step, path in reversed(complete_checkpoints(checkpoints_dir)):
        marker = read_marker(path)
        saved = marker.get("knobs", {}) if marker is not None else None
        damaged = damaged_files(path) if isinstance(saved, dict) else None
        if saved is None or damaged is None:
            skipped.append(f"{path.name}: unreadable marker")
            continue
        why = "; ".join(f"{name}: {problem}" for name, problem in sorted(damaged.items()))
        # Only the optimizer state damaged: the adapter and the step are good; resume them with a
        # fresh optimizer (the LR schedule follows the step) rather than lose the steps.
        optimizer_only = bool(damaged) and set(damaged) <= set(OPTIMIZER_FILES)
        if damaged and not optimizer_only:
            skipped.append(f"{path.name}: damaged ({why})")
            if quarantine_damaged:
                reason = f"files differ from the completion marker: {why}"
                moved.append(Quarantined(path, quarantine(path, reason), reason))
            continue
        if optimizer_only:
            skipped.append(f"{path.name}: optimizer state damaged ({why}); resumed with a fresh optimizer")
        if not saved:  # a marker without knobs (written by hand or another tool): trust its shape
            return ResumePoint(step, path, optimizer_only, tuple(skipped), tuple(moved))
        why_not = _unloadable(saved, knobs)
        if why_not is not None:
            skipped.append(f"{path.name}: {why_not}")
            continue
        rank_from = _larger_rank(saved, knobs)
        reset = (
            optimizer_only
            or rank_from is not None
            or saved.get("optimizer") != knobs.optimizer
            # the fresh_optimizer_state rung, against a checkpoint written before it
            or bool(saved.get("fresh_optimizer_state", False)) != knobs.fresh_optimizer_state
            # FSDP lays its optimizer state out its own way (optimizer.bin): one mode cannot read the other's
            or bool(saved.get("fsdp", False)) != knobs.fsdp
        )
        return ResumePoint(step, path, reset, tuple(skipped), tuple(moved), rank_from)
    return ResumePoint(0, None, False, tuple(skipped), tuple(moved))


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


def quarantine_reported(report: ErrorReport | None, checkpoints_dir: Path) -> Quarantined | None:
    """Move aside the checkpoint a child could not load (its report names it); None when the
    report names none, or names something that is not one of this run's checkpoints any more."""
    named = report.damaged_checkpoint if report is not None else None
    if not named:
        return None
    path = Path(named)
    if path.parent.resolve() != checkpoints_dir.resolve() or not path.is_dir():
        return None
    reason = f"failed to load in the child: {report.exception_type}: {report.message[:300]}" if report else ""
    return Quarantined(path, quarantine(path, reason), reason)


def clean_staging(run_root: Path, checkpoints_dir: Path) -> list[Path]:
    """Delete staging directories whose writer is gone: ``.tmp-*`` under ``checkpoints/`` and the
    adapter's ``.tmp-adapter-<pid>`` / ``.old-adapter-<pid>`` in the run directory.

    Called when the run ends, whatever the verdict: a next child would clean them, but a run that
    gave up has no next child. A writer still alive (its pid in the name) keeps its directory.
    """
    removed = remove_stale_temps(checkpoints_dir)
    if not run_root.is_dir():
        return removed
    for path in run_root.iterdir():
        tail = path.name.rsplit("-", 1)[-1]
        ours = path.name.startswith((TEMP_PREFIX, ".old-")) and tail.isdigit()
        if ours and path.is_dir() and not pid_alive(int(tail)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def log_quarantined(log: FilteringBoundLogger, moved: tuple[Quarantined, ...] | list[Quarantined]) -> None:
    """One ``checkpoint_quarantined`` warning per checkpoint moved aside."""
    for item in moved:
        log.warning(
            Event.CHECKPOINT_QUARANTINED,
            checkpoint=item.path.name,
            moved_to=str(item.moved_to),
            why=item.why,
            resume="the next attempt resumes from the newest checkpoint still intact",
        )
