"""The step-up and re-time rules as pure functions (issue 34): causes, and when a restart is not worth it."""

from __future__ import annotations

import dataclasses

import pytest

from qlora_supervise.policies.choice import Sharing, Trial, first_for, retime
from qlora_supervise.policies.decide import Settings
from qlora_supervise.policies.ladder.step_up import (
    CardNow,
    Cause,
    Descent,
    Refusal,
    StepUp,
    cause_of,
    step_up,
)
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.spec import Knobs, TrialCandidate

GiB = 1 << 30
DATA = [60] * 99 + [4000]
FAST = Knobs(model="m", micro_batch_size=4, grad_accum=2, gradient_checkpointing=False)
SLOW = dataclasses.replace(FAST, gradient_checkpointing=True)


@pytest.mark.parametrize(
    ("kind", "spurious", "batch", "cause"),
    [
        (FailureKind.OOM_CONTENTION, False, [], Cause.CONTENTION),
        (FailureKind.OOM_FRAGMENTATION, False, [], Cause.TRANSIENT),
        (FailureKind.OOM_FORWARD, True, [], Cause.TRANSIENT),
        (FailureKind.OOM_FORWARD, False, [4000, 60], Cause.LONG_SAMPLE),
        (FailureKind.OOM_FORWARD, False, [60, 60], None),
        (FailureKind.HOST_OOM, False, [], None),
        (FailureKind.HANG, True, [4000], None),
    ],
)
def test_each_failure_names_its_cause_or_none(
    kind: FailureKind, spurious: bool, batch: list[int], cause: Cause | None
) -> None:
    """Contention, a transient OOM and a long sample are causes that clear; a plain OOM is none."""
    assert cause_of(kind, spurious, batch, DATA) is cause


def _descent(before_peak: int | None) -> Descent:
    return Descent(1, Cause.TRANSIENT, FailureKind.OOM_FRAGMENTATION, "", FAST, SLOW, 3, before_peak)


def test_no_step_up_before_the_failed_step_is_passed_nor_without_a_known_peak() -> None:
    """A transient cause clears past the step that failed; with no peak to check the margin by
    (none measured, no memory model) the step-up is refused."""
    settings = Settings(budget_bytes=20 * GiB)
    assert step_up(SLOW, [_descent(8 * GiB)], [], settings, CardNow(3, 24 * GiB, 0, 0.0)) is None
    up = step_up(SLOW, [_descent(8 * GiB)], [], settings, CardNow(4, 24 * GiB, 0, 0.0))
    assert isinstance(up, StepUp) and up.knobs == FAST
    refused = step_up(SLOW, [_descent(None)], [], settings, CardNow(4, 24 * GiB, 0, 0.0))
    assert isinstance(refused, Refusal) and "no margin to check" in refused.why


CANDIDATES = (
    TrialCandidate(4, 2, False, predicted_tokens_per_s=1000.0),
    TrialCandidate(2, 4, False, predicted_tokens_per_s=700.0),
)


def test_a_retime_waits_for_the_whole_settle_time_and_is_worth_its_restart() -> None:
    """Sharing changed for less than the settle time, or too little training left to win back the
    restart, or a config changed beyond the trial's knobs: no re-time."""
    trial, trained = Trial(FAST, CANDIDATES), dataclasses.replace(FAST, micro_batch_size=2, grad_accum=4)
    then, gone, some = Sharing(8 * GiB), Sharing(0), Sharing(7 * GiB)
    assert retime(trial, trained, then, [gone, gone], 30.0, 60.0) is None  # not for the settle time yet
    assert retime(trial, trained, then, [some, gone], 90.0, 60.0) is None  # not changed all along
    assert retime(trial, trained, then, [gone, gone], 90.0, 60.0, remaining_s=150.0) is None  # saves 45 s
    to = retime(trial, trained, then, [gone, gone], 90.0, 60.0, remaining_s=3600.0)
    assert to is not None and to[0] == FAST and "43% faster" in to[1]
    assert retime(trial, dataclasses.replace(trained, max_seq_len=256), then, [gone], 90.0, 60.0) is None
    assert retime(trial, FAST, then, [gone], 90.0, 60.0) is None  # already the fastest predicted
    assert first_for(trained, CANDIDATES) == (CANDIDATES[1], CANDIDATES[0])
    assert first_for(dataclasses.replace(trained, micro_batch_size=1, grad_accum=8), CANDIDATES) == ()


def test_the_sharing_changes_by_memory_or_by_the_others_utilisation() -> None:
    """2 GiB of the others' memory, or 30 points of their SM utilisation where both readings have it."""
    assert Sharing(8 * GiB).differs(Sharing(5 * GiB)) and not Sharing(8 * GiB).differs(Sharing(7 * GiB))
    assert Sharing(0, 90).differs(Sharing(0, 10)) and not Sharing(0, 90).differs(Sharing(0, 70))
    assert not Sharing(0, 90).differs(Sharing(0, None))  # one reading without it: memory decides


def test_a_dropped_rank_and_a_free_rung_are_never_undone() -> None:
    """A descent that dropped a rank (accumulation doubled with it) is not undone, since undoing the
    accumulation alone would halve the effective batch; nor is a free rung (expandable_segments)."""
    settings = Settings(budget_bytes=20 * GiB)
    card = CardNow(4, 24 * GiB, 0, 0.0)
    two = dataclasses.replace(FAST, world_size=2, gpus="0,1")
    one = dataclasses.replace(two, world_size=1, gpus="0", grad_accum=4)
    dropped = Descent(1, Cause.TRANSIENT, FailureKind.OOM_FRAGMENTATION, "", two, one, 3, 8 * GiB)
    answer = step_up(one, [dropped], [], settings, card)
    assert not isinstance(answer, StepUp)
    segments = dataclasses.replace(FAST, expandable_segments=True)
    off = dataclasses.replace(FAST, expandable_segments=False)
    free = Descent(1, Cause.TRANSIENT, FailureKind.OOM_FRAGMENTATION, "", off, segments, 3, 8 * GiB)
    assert not isinstance(step_up(segments, [free], [], settings, card), StepUp)
    both = dataclasses.replace(SLOW, expandable_segments=True)
    mixed = Descent(1, Cause.TRANSIENT, FailureKind.OOM_FRAGMENTATION, "", off, both, 3, 8 * GiB)
    up = step_up(both, [mixed], [], settings, card)
    assert isinstance(up, StepUp) and up.knobs == dataclasses.replace(FAST, expandable_segments=True)
