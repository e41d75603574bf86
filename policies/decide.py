"""The decision after a failed attempt: ``Restart | Wait | GiveUp``, a value the loop carries out.

The rules, first match wins (docs/ladder.md tells them for users):

0. a non-OOM failure right after a rung changed the config, no step trained: the rung is charged
   (:mod:`.ladder.charge`): reverted, unusable for the run, the ladder goes on from the failure before
1. a failure no config can fix (config error, bitsandbytes setup) -> GiveUp, not retryable
2. the attempt budget is spent -> GiveUp
3. ``max_no_progress`` attempts in a row trained no step with no config change -> GiveUp (crash loop)
4. contention the job may not degrade for, or a full disk -> Wait, then Restart unchanged once the
   memory or room came back (or there is no reading), else GiveUp (:mod:`.ladder.waits`)
5. hang / nccl / other / a GPU fault -> Restart unchanged, until the same failure repeated
   ``max_no_progress`` times (a GPU fault: twice) with no step trained in between; a fatal Xid
   -> GiveUp, not retryable. Under torchrun a card that keeps failing -> ``drop_rank``
6. memory failures -> the next config as :mod:`.choice` decides it, after two plain retries: a host
   OOM kill after progress not in a row (:mod:`.ladder.host_kill`) and an OOM marked spurious, once
   (:mod:`.ladder.spurious_retry`); a merge's memory failure takes the merge ladder.

The values live in :mod:`.verdicts`, the waits in :mod:`.ladder.waits`.
"""

from __future__ import annotations

from collections.abc import Sequence

from qlora_supervise.policies.choice import after_failure
from qlora_supervise.policies.ladder.charge import Charge, PastFailure, latest_charge, unusable_rungs
from qlora_supervise.policies.ladder.host_kill import host_settings, retry_after_kill
from qlora_supervise.policies.ladder.spurious_retry import retry_spurious
from qlora_supervise.policies.ladder.waits import (
    after_contention,
    after_disk_full,
    bytes_needed,
    gpu_broken,
    without_card,
)
from qlora_supervise.policies.rungs import Survives
from qlora_supervise.policies.search.search_result import knob_changes
from qlora_supervise.policies.verdicts import (
    Decision,
    FailureLike,
    GiveUp,
    MergeFailure,
    PastAttempt,
    Restart,
    Settings,
    Wait,
    WaitFor,
    WaitResult,
)
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.spec import Knobs

__all__ = [
    "Decision",
    "FailureLike",
    "GiveUp",
    "PastAttempt",
    "Restart",
    "Settings",
    "Wait",
    "WaitFor",
    "WaitResult",
    "bytes_needed",
    "decide",
    "knob_changes",
]

NOT_RETRYABLE = frozenset({FailureKind.CONFIG_ERROR, FailureKind.BNB_CUDA_SETUP})
RETRY_UNCHANGED_ONCE = frozenset(
    {FailureKind.HANG, FailureKind.NCCL, FailureKind.OTHER, FailureKind.GPU_FAULT}
)


def decide(
    failure: FailureLike,
    knobs: Knobs,
    history: Sequence[PastAttempt],
    settings: Settings,
    waited: WaitResult | None = None,
    phase: str = "train",
) -> Decision:
    """What to do after ``failure`` of an attempt that ran with ``knobs``.

    ``history``: every finished attempt, the failed one last; those that did not fail count toward
    neither the attempt budget nor the crash-loop streak. In the ``merge`` phase a memory failure
    takes the merge ladder (a smaller model would merge the adapter onto the wrong base).
    """
    kind = failure.kind
    failed = [past for past in history if past.kind is not None]
    if kind is FailureKind.GPU_FAULT and failure.fatal_xid is not None:
        return without_card(failure, knobs, "the card reported a fatal Xid") or gpu_broken(failure)
    charged = latest_charge(history) if phase == "train" else None
    if charged is not None and len(failed) < settings.max_attempts:
        return _revert(charged, knobs, history, settings)
    if kind in NOT_RETRYABLE:
        return GiveUp(f"{kind.value} cannot be fixed by changing the training config", retryable=False)
    if len(failed) >= settings.max_attempts:
        return GiveUp(f"all {settings.max_attempts} attempts used (supervise.max_attempts)")
    # Under torchrun a rank whose failure keeps coming back costs its card, not the run.
    named = kind in RETRY_UNCHANGED_ONCE and getattr(failure, "local_rank", None) is not None
    if _no_progress_streak(failed) >= settings.max_no_progress:
        crash_loop = GiveUp(
            f"{settings.max_no_progress} attempts in a row trained no step with the same config "
            "(crash loop); see attempts.jsonl"
        )
        return (without_card(failure, knobs, f"{kind.value} came back") if named else None) or crash_loop
    if kind is FailureKind.OOM_CONTENTION and not settings.degrade_on_contention:
        return after_contention(failure, knobs, settings, waited)
    if kind is FailureKind.DISK_FULL:
        return after_disk_full(failure, knobs, settings, waited)
    if kind in RETRY_UNCHANGED_ONCE:
        # A GPU that faulted is retried once (issue 9); other transient kinds up to the crash-loop limit.
        limit = 2 if kind is FailureKind.GPU_FAULT else settings.max_no_progress
        retried = _retry_unchanged(kind, knobs, history, limit)
        if isinstance(retried, GiveUp) and (kind is FailureKind.GPU_FAULT or named):
            why = "the card faulted again" if kind is FailureKind.GPU_FAULT else f"{kind.value} came back"
            return without_card(failure, knobs, why) or retried
        return retried
    plain_retry = retry_after_kill(failure, knobs, failed) if phase == "train" else None
    if plain_retry is not None:  # 6a: a host OOM kill after progress, the first with these knobs
        return plain_retry
    spurious = retry_spurious(failure, knobs, failed) if kind.is_oom else None
    if spurious is not None:  # 6b: the allocator's numbers say the request fit: retried once
        return spurious
    if phase == "merge" and kind.is_oom:
        return after_failure(MergeFailure(), knobs, history, settings)
    # A host OOM's ladder puts throughput before quality, the rank only where the adapter grew.
    settings = host_settings(failure, settings, failed)
    return after_failure(failure, knobs, history, settings, unusable_rungs(history))


def _revert(charged: Charge, knobs: Knobs, history: Sequence[PastAttempt], settings: Settings) -> Decision:
    """Rule 0: the charged rungs go (back to the config before them) and the ladder moves on from
    the failure they answered, without them for the rest of the run."""
    names = "+".join(charged.rungs)
    head = (
        f"{charged.kind.value} right after {names} changed the config (no attempt failed so before): "
        f"{names} reverted and unusable for this run"
    )
    before = charged.before
    unusable = unusable_rungs(history)
    following = after_failure(PastFailure.of(before), before.knobs, history, settings, unusable)
    if isinstance(following, GiveUp):
        return GiveUp(f"{head}; {following.why}", retryable=following.retryable)
    if not isinstance(following, Restart):
        return following
    changes = knob_changes(knobs, following.knobs)
    # Going back to another rank or model is a new adapter, whatever the rung that follows keeps.
    survives = Survives.ADAPTER_REINIT if {"lora_r", "model"} & set(changes) else following.survives
    return Restart(following.knobs, following.rung, changes, f"{head}; then: {following.why}", survives)


def _no_progress_streak(history: Sequence[PastAttempt]) -> int:
    """Attempts at the end of the history that trained no step and ran the config of the one
    before, and the first of them (a ladder climbing at step 0 ends on its own)."""
    streak = 0
    for index in range(len(history) - 1, -1, -1):
        past = history[index]
        if past.steps_progressed > 0:
            break
        if index > 0 and history[index - 1].knobs != past.knobs:
            return streak + 1
        streak += 1
    return streak


def _retry_unchanged(kind: FailureKind, knobs: Knobs, history: Sequence[PastAttempt], limit: int) -> Decision:
    same = _same_failures_since_progress(kind, knobs, history)
    if same >= max(2, limit):
        return GiveUp(
            f"{kind.value} happened {same} times with the same config and no step trained in between; "
            "no rung addresses it"
        )
    return Restart(
        knobs, "retry_unchanged", {}, f"{kind.value} may be transient: retry unchanged", Survives.ALL
    )


def _same_failures_since_progress(kind: FailureKind, knobs: Knobs, history: Sequence[PastAttempt]) -> int:
    """Failures of ``kind`` with ``knobs`` back to (and including) the newest attempt that trained
    steps: the ones before it were followed by training, so they were transient."""
    same = 0
    for past in reversed(history):
        if past.kind is kind and past.knobs == knobs:
            same += 1
        if past.steps_progressed > 0:
            break
    return same
