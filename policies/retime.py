"""Timing the speed trial again when the card's sharing has changed since it ran (issue 34).

When the others' memory or SM use (NVML) has differed from the trial's for the whole settle time,
and a candidate is predicted at least ``MIN_GAIN`` faster than the one trained by more than
:data:`RESTART_COST_S` on the time left, the next checkpoint restarts with it to time the trial
again (docs/ladder.md: beside three jobs on an H200 a trial chose micro 2, wrong once they left).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from qlora_supervise.policies.choice import MIN_GAIN, trained_with
from qlora_supervise.trainer_child.contract.spec import Knobs, TrialCandidate

RETIME_RUNG = "retime"
#: How far the others' memory, or their SM utilisation (percentage points), must move to count.
SHARING_CHANGE_BYTES = 2 << 30
SHARING_CHANGE_UTIL = 30
#: What a planned restart costs in training time: the warm spare's start, the resume, the trial.
RESTART_COST_S = 60.0


@dataclass(frozen=True)
class Sharing:
    """What the other processes on the card held (bytes) and used (SM percent; None: not reported)."""

    others_bytes: int
    others_sm_util: int | None = None

    def differs(self, other: Sharing) -> bool:
        if abs(self.others_bytes - other.others_bytes) >= SHARING_CHANGE_BYTES:
            return True
        util = (self.others_sm_util, other.others_sm_util)
        return None not in util and abs((util[0] or 0) - (util[1] or 0)) >= SHARING_CHANGE_UTIL

    def text(self) -> str:
        util = f", {self.others_sm_util} % of the SMs" if self.others_sm_util is not None else ""
        return f"{self.others_bytes / (1 << 30):.1f} GiB{util}"


@dataclass(frozen=True)
class Trial:
    """The pre-flight's trial: its config (the first candidate) and every candidate."""

    knobs: Knobs
    candidates: tuple[TrialCandidate, ...]
    limit: int | None = None


def retime(
    first: Trial,
    knobs: Knobs,
    then: Sharing | None,
    window: Sequence[Sharing],
    held_for_s: float,
    settle_s: float,
    remaining_s: float = math.inf,
) -> tuple[Knobs, str] | None:
    """The knobs to restart with and why, to time the trial again now; None: not now."""
    if then is None or not window or held_for_s < settle_s:
        return None
    if not all(now.differs(then) for now in window):
        return None
    # The candidate ``knobs`` trains, when they differ from the pre-flight's only in the trial's knobs.
    trained = next((c for c in first.candidates if trained_with(first.knobs, c) == knobs), None)
    if trained is None:
        return None  # the run has changed more than the trial's knobs since: its candidates are stale
    planned = max(first.candidates, key=lambda c: c.predicted_tokens_per_s or 0.0)
    fast, slow = planned.predicted_tokens_per_s, trained.predicted_tokens_per_s
    if not fast or not slow or fast < slow * (1 + MIN_GAIN):
        return None
    saved_s = remaining_s * (1 - slow / fast)
    if saved_s <= RESTART_COST_S:
        return None
    why = (
        f"the card's sharing changed: others held {then.text()} at the trial, {window[-1].text()} now "
        f"and different all of the last {held_for_s:.0f}s; {_name(planned)} is "
        f"predicted {fast / slow - 1:.0%} faster than the trained {_name(trained)}: time the trial again"
    )
    return trained_with(knobs, planned), why


def first_for(knobs: Knobs, candidates: tuple[TrialCandidate, ...]) -> tuple[TrialCandidate, ...]:
    """The trial's candidates with the one ``knobs`` trains first (the trial's rule: the spec's own
    first); none when ``knobs`` is no candidate (a supervisor restarted since, planning anew)."""
    own = [c for c in candidates if trained_with(knobs, c) == knobs]
    return (*own, *(c for c in candidates if c not in own)) if own else ()


def _name(c: TrialCandidate) -> str:
    return f"micro-batch {c.micro_batch_size}" + (" with checkpointing" if c.gradient_checkpointing else "")
