"""Timing the speed trial again when the card's sharing has changed since it ran (issue 34).

The trial ranks its candidates on the card as it is: beside three other jobs on an H200 it chose
micro-batch 2 over the planner's 4, right while the card was shared and wrong once the others had
gone. When the other processes' memory (NVML) has differed from what it was at the trial by
:data:`SHARING_CHANGE_BYTES` or more for the whole settle time, and the attempt trains a candidate
other than the pre-flight's own, the next checkpoint restarts it with the pre-flight's config and
candidates, and the restarted child times them again before it goes on (the trial runs on a
resume too when its spec says so). Only when the gain is worth the restart: the pre-flight's
predicted tokens/s over the trained candidate's, on the time left, must win back more than
:data:`RESTART_COST_S`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

from qlora_supervise.trainer_child.contract.spec import Knobs
from qlora_supervise.trainer_child.contract.speed_trial import MIN_GAIN, TrialCandidate

RETIME_RUNG = "retime"
SHARING_CHANGE_BYTES = 2 << 30
#: What a planned restart costs in training time: the warm spare's start, the resume, the trial.
RESTART_COST_S = 60.0


@dataclass(frozen=True)
class Trial:
    """The pre-flight's trial: its config (the first candidate) and every candidate."""

    knobs: Knobs
    candidates: tuple[TrialCandidate, ...]
    limit: int | None = None


def retime(
    first: Trial,
    knobs: Knobs,
    others_then: int | None,
    window: Sequence[int],
    held_for_s: float,
    settle_s: float,
    remaining_s: float = math.inf,
) -> str | None:
    """Why to time the trial again now, or None (see the module docstring)."""
    if others_then is None or not window or held_for_s < settle_s or knobs == first.knobs:
        return None
    if any(abs(others - others_then) < SHARING_CHANGE_BYTES for others in window):
        return None
    trained, planned = _candidate(first, knobs), _candidate(first, first.knobs)
    if trained is None or planned is None:
        return None  # the run has changed more than the trial's knobs since: its candidates are stale
    fast, slow = planned.predicted_tokens_per_s, trained.predicted_tokens_per_s
    if not fast or not slow or fast < slow * (1 + MIN_GAIN):
        return None
    saved_s = remaining_s * (1 - slow / fast)
    if saved_s <= RESTART_COST_S:
        return None
    gib = 1 << 30
    return (
        f"the card's sharing changed: others held {others_then / gib:.1f} GiB at the trial, "
        f"{min(window) / gib:.1f}-{max(window) / gib:.1f} GiB for {held_for_s:.0f}s; the plan's "
        f"micro-batch {planned.micro_batch_size} is predicted {fast / slow - 1:.0%} faster than the "
        f"trained {trained.micro_batch_size}: time the trial again"
    )


def _candidate(first: Trial, knobs: Knobs) -> TrialCandidate | None:
    """The candidate ``knobs`` trains, when they differ from the pre-flight's only in the trial's knobs."""
    for c in first.candidates:
        as_c = (c.micro_batch_size, c.grad_accum, c.gradient_checkpointing)
        if (knobs.micro_batch_size, knobs.grad_accum, knobs.gradient_checkpointing) != as_c:
            continue
        same_rest = dataclasses.replace(
            knobs,
            micro_batch_size=first.knobs.micro_batch_size,
            grad_accum=first.knobs.grad_accum,
            gradient_checkpointing=first.knobs.gradient_checkpointing,
        )
        return c if same_rest == first.knobs else None
    return None
