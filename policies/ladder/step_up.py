"""Stepping back up: a rung taken for a cause that has cleared is undone at a checkpoint (issue 34).
A :class:`Descent` is a rung the ladder took, with its :class:`Cause` (docs/ladder.md tells when
each clears); any other OOM says the config does not fit. :func:`step_up` answers with a
:class:`StepUp` or a :class:`Refusal`: at most once per descent, never to a config a step-up
reached that then failed, never without the pre-flight's margin."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qlora_supervise.policies import memory_model
from qlora_supervise.policies.rungs import RUNGS, CostClass, knob_changes, rungs_between
from qlora_supervise.policies.search.search_state import fit_limit
from qlora_supervise.policies.verdicts import Settings
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.spec import Knobs

STEP_UP_RUNG = "step_up"  # The journal's rung name of a planned restart to a faster config.
LONG_SAMPLE_SHARE = 0.99  # A sample is "long" when it is longer than this share of the data's samples.
#: The knobs a step-up leaves as they are unless ``Settings.step_up_quality`` allows it.
QUALITY_KNOBS = frozenset(r.knob for r in RUNGS if r.cost is CostClass.QUALITY)
#: Never undone: a larger rank or another model is a new adapter, and a dropped card kept failing.
KEPT_ALWAYS = frozenset({"lora_r", "lora_alpha", "model", "world_size", "gpus"})
#: The knobs of the free rungs: never undone, since they cost no speed.
FREE_KNOBS = frozenset(r.knob for r in RUNGS if r.cost is CostClass.FREE)


class Cause(str, enum.Enum):
    """Why a rung was taken: contention (cleared when the others held at most half as much for the
    settle time), a transient OOM or a long sample (cleared once past the step that failed)."""

    CONTENTION = "contention"
    TRANSIENT = "transient"
    LONG_SAMPLE = "long_sample"


@dataclass(frozen=True)
class Descent:
    """A rung the ladder took: attempt ``attempt`` failed with ``before``; the next ran ``after``."""

    attempt: int
    cause: Cause
    kind: FailureKind
    evidence: str
    before: Knobs
    after: Knobs
    failed_step: int  # the step the failure happened in (its micro-batch's, else the last finished + 1)
    before_peak: int | None = None  # the peak measured with ``before`` (None: not measured)
    others_bytes: int | None = None  # NVML: the other processes' memory when it failed


@dataclass(frozen=True)
class PastStepUp:
    """A step-up the journal holds: to ``knobs``, undoing the descent of attempt ``descent``."""

    descent: int
    knobs: Knobs
    failed: bool  # the attempt that ran ``knobs`` failed


@dataclass(frozen=True)
class CardNow:
    """The card at a checkpoint: the others' memory now, how long it has been at most that, the step."""

    step: int
    total_bytes: int | None
    others_bytes: int | None
    others_low_for_s: float  # seconds the others' memory has stayed at or below ``others_bytes``


@dataclass(frozen=True)
class StepUp:
    knobs: Knobs
    descent: Descent
    changes: dict[str, tuple[Any, Any]]
    why: str


@dataclass(frozen=True)
class Refusal:
    descent: Descent
    why: str


def cause_of(
    kind: FailureKind, spurious: bool, batch_lengths: Sequence[int], data_lengths: Sequence[int]
) -> Cause | None:
    """The cause a failure names, or None when it says the config does not fit."""
    if kind is FailureKind.OOM_CONTENTION:
        return Cause.CONTENTION
    if kind is FailureKind.OOM_FRAGMENTATION or (kind.is_oom and spurious):
        return Cause.TRANSIENT
    if kind.is_oom and batch_lengths and data_lengths:
        ordered = sorted(data_lengths)
        long_from = ordered[min(len(ordered) - 1, int(LONG_SAMPLE_SHARE * len(ordered)))]
        if max(batch_lengths) >= long_from and max(batch_lengths) > ordered[len(ordered) // 2]:
            return Cause.LONG_SAMPLE
    return None


def step_up(
    knobs: Knobs, descents: Sequence[Descent], past: Sequence[PastStepUp], settings: Settings, card: CardNow
) -> StepUp | Refusal | None:
    """At a checkpoint of an attempt running ``knobs``: the step-up to take, the refusal of the newest
    cleared descent, or None when no cause has cleared."""
    if not settings.step_up:
        return None
    refusal = None
    for descent in reversed(descents):
        # Its change no longer in ``knobs``: undone already (a step-up), or another config since.
        changed = knob_changes(descent.before, descent.after)
        still_in = all(getattr(knobs, name) == value for name, (_, value) in changed.items())
        if not still_in or not _cleared(descent, settings, card):
            continue
        answer = _answer(knobs, descent, past, settings, card)
        if isinstance(answer, StepUp):
            return answer
        refusal = refusal or answer
    return refusal


def _cleared(descent: Descent, settings: Settings, card: CardNow) -> bool:
    """Contention: for the whole settle time the others held at most half what they held at the
    failure (half the card when that is unknown); the others: past the step that failed."""
    if descent.cause is not Cause.CONTENTION:
        return card.step > descent.failed_step
    if card.others_bytes is None or card.others_low_for_s < settings.step_up_settle_s:
        return False
    before = descent.others_bytes if descent.others_bytes is not None else card.total_bytes
    return before is not None and card.others_bytes <= before // 2


def _answer(
    knobs: Knobs, descent: Descent, past: Sequence[PastStepUp], settings: Settings, card: CardNow
) -> StepUp | Refusal:
    changed = knob_changes(descent.before, descent.after)
    # ``knobs`` with the descent's changes undone, quality knobs only when allowed; none when it
    # changed a knob kept for good (undoing ``drop_rank``'s accumulation alone would halve the batch).
    # A free rung costs no speed: undoing it gains nothing and brings back its failure.
    kept = FREE_KNOBS if settings.step_up_quality else FREE_KNOBS | QUALITY_KNOBS
    undo = {name: before for name, (before, _) in changed.items() if name not in kept}
    target = dataclasses.replace(knobs, **undo) if undo and not set(changed) & KEPT_ALWAYS else knobs
    if target == knobs:
        leaves = "quality knobs (unless supervise.step_up_quality), the rank, the model, the ranks"
        return Refusal(descent, f"the rung changed only what a step-up leaves: {leaves}")
    if any(p.descent == descent.attempt for p in past):
        why = f"attempt {descent.attempt}'s {descent.cause.value} was stepped up once already"
        return Refusal(descent, why)
    if any(p.knobs == target and p.failed for p in past):
        return Refusal(descent, "a step-up to this config failed before")
    # The budget left by the others: the job's budget, or the card less what the others hold now.
    room = settings.budget_bytes
    if card.total_bytes is not None and card.others_bytes is not None:
        free = card.total_bytes - card.others_bytes
        room = free if room is None else min(room, free)
    # The peak: the larger of the memory model's calibrated one and the one ``target`` was measured
    # at (a free rung kept on, expandable_segments, lowers the peak at most: the measured one bounds it).
    measured = descent.before_peak if set(knob_changes(target, descent.before)) <= FREE_KNOBS else None
    predicted = None
    if settings.shape is not None:
        scale = memory_model.calibrate(settings.shape, settings.prior, settings.targets)
        predicted = memory_model.estimate_peak(settings.shape, target, scale, settings.targets)
    peak = max((p for p in (measured, predicted) if p is not None), default=None)
    if peak is None or room is None:
        return Refusal(descent, "no margin to check: no peak known for the faster config, or no budget")
    if peak > fit_limit(room):
        return Refusal(descent, f"predicted peak {_gib(peak)} does not fit {_gib(room)} free with the margin")
    names = "+".join(rungs_between(target, knobs)) or "the rung"
    if descent.cause is Cause.CONTENTION:
        held = f"{_gib(descent.others_bytes)} then" if descent.others_bytes is not None else "then"
        evidence = f"others held {held}, {_gib(card.others_bytes)} for {card.others_low_for_s:.0f}s now"
    else:
        evidence = f"{descent.kind.value} at step {descent.failed_step}, now at step {card.step}"
    why = (
        f"{descent.cause.value} cleared ({evidence}): undo {names} of attempt {descent.attempt}; "
        f"predicted peak {_gib(peak)} fits {_gib(room)} with the margin"
    )
    return StepUp(target, descent, knob_changes(knobs, target), why)


def _gib(value: int | None) -> str:
    return "?" if value is None else f"{value / (1 << 30):.1f} GiB"
