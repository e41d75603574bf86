"""The decision after a failed attempt: ``Restart | Wait | GiveUp`` (:mod:`.verdicts`), a value the
loop carries out. The rules, first match wins (docs/ladder.md tells them for users; the rules after
the first few are below :func:`decide`):

0. a non-OOM failure right after a rung changed the config, no step trained: the rung is charged
   (below): reverted, unusable for the run, the ladder goes on from the failure before
1. a failure no config can fix (config error, bitsandbytes setup) -> GiveUp, not retryable
2. the attempt budget is spent -> GiveUp
3. ``max_no_progress`` attempts in a row trained no step with no config change -> GiveUp (crash loop)
4. contention the job may not degrade for, or a full disk -> Wait, then Restart unchanged once the
   memory or room came back (or there is no reading), else GiveUp
5. hang / nccl / other / a GPU fault -> Restart unchanged, until the same failure repeated
   ``max_no_progress`` times (a GPU fault: twice) with no step trained in between; a fatal Xid
   -> GiveUp, not retryable. Under torchrun a card that keeps failing -> ``drop_rank``
6. memory failures -> the next config as :mod:`.choice` decides it, after two plain retries: a host
   OOM kill after progress not in a row and an OOM marked spurious, once (issue 33, below); a
   merge's memory failure takes the merge ladder."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qlora_supervise.policies import rungs
from qlora_supervise.policies.choice import after_failure
from qlora_supervise.policies.rungs import RUNG_CLASSES, CostClass, Survives, knob_changes, ladder_for
from qlora_supervise.policies.verdicts import Decision, FailureLike, GiveUp, PastAttempt, Restart, Settings
from qlora_supervise.policies.verdicts import Wait as Wait
from qlora_supervise.policies.verdicts import WaitFor as WaitFor
from qlora_supervise.policies.verdicts import WaitResult as WaitResult
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage
from qlora_supervise.trainer_child.contract.spec import Knobs

#: What the loop reads of the decision's values through this module.
__all__ = ["Decision", "GiveUp", "PastAttempt", "Restart", "Settings", "Wait", "WaitFor", "WaitResult"]
NOT_RETRYABLE = frozenset({FailureKind.CONFIG_ERROR, FailureKind.BNB_CUDA_SETUP})
RETRY_UNCHANGED_ONCE = frozenset(map(FailureKind, ("hang", "nccl", "other", "gpu_fault")))


def decide(
    failure: FailureLike,
    knobs: Knobs,
    history: Sequence[PastAttempt],
    settings: Settings,
    waited: WaitResult | None = None,
    phase: str = "train",
) -> Decision:
    """What to do after ``failure`` of an attempt that ran with ``knobs``. ``history``: every finished
    attempt, the failed one last; those that did not fail count toward neither the attempt budget nor
    the crash-loop streak. In the ``merge`` phase a memory failure takes the merge ladder (a smaller
    model would merge the adapter onto the wrong base)."""
    kind = failure.kind
    failed = [past for past in history if past.kind is not None]
    if kind is FailureKind.GPU_FAULT and failure.fatal_xid is not None:
        # A fatal Xid: the GPU must be reset or replaced; no config, and no retry, helps on it.
        return without_card(failure, knobs, "the card reported a fatal Xid") or GiveUp(
            f"the GPU reported fatal Xid {failure.fatal_xid}: it needs a reset (nvidia-smi -r) or a "
            "hardware check; nothing was retried on it (the checkpoints are kept)",
            retryable=False,
        )
    charged = charge_at(history, len(history) - 1) if phase == "train" and history else None
    if charged is not None and len(failed) < settings.max_attempts:
        return _revert(charged, knobs, history, settings)
    if kind in NOT_RETRYABLE:
        return GiveUp(f"{kind.value} cannot be fixed by changing the training config", retryable=False)
    if len(failed) >= settings.max_attempts:
        return GiveUp(f"all {settings.max_attempts} attempts used (supervise.max_attempts)")
    named = kind in RETRY_UNCHANGED_ONCE and getattr(failure, "local_rank", None) is not None
    if _no_progress_streak(failed) >= settings.max_no_progress:
        streak = f"{settings.max_no_progress} attempts in a row trained no step with the same config"
        crash_loop = GiveUp(f"{streak} (crash loop); see attempts.jsonl")
        return (without_card(failure, knobs, f"{kind.value} came back") if named else None) or crash_loop
    if kind is FailureKind.OOM_CONTENTION and not settings.degrade_on_contention:
        return _contended(failure, knobs, settings, waited)
    if kind is FailureKind.DISK_FULL:
        return _disk_full(failure, knobs, settings, waited)
    if kind in RETRY_UNCHANGED_ONCE:
        limit = 2 if kind is FailureKind.GPU_FAULT else settings.max_no_progress
        retried = _retry_unchanged(kind, knobs, history, limit)
        if isinstance(retried, GiveUp) and (kind is FailureKind.GPU_FAULT or named):
            why = "the card faulted again" if kind is FailureKind.GPU_FAULT else f"{kind.value} came back"
            return without_card(failure, knobs, why) or retried
        return retried
    # 6a: a host OOM kill after progress, the first with these knobs; 6b: an OOM marked spurious, once.
    retry = retry_after_kill(failure, knobs, failed) if phase == "train" else None
    retry = retry or (retry_spurious(failure, knobs, failed) if kind.is_oom else None)
    if retry is not None:
        return retry
    if phase == "merge" and kind.is_oom:
        return after_failure(PastFailure(FailureKind.OOM_MERGE, Stage.MERGE), knobs, history, settings)
    # A host OOM's ladder puts throughput before quality, the rank only where the adapter grew.
    settings = host_settings(failure, settings, failed)
    return after_failure(failure, knobs, history, settings, unusable_rungs(history))


def _revert(charged: Charge, knobs: Knobs, history: Sequence[PastAttempt], settings: Settings) -> Decision:
    """Rule 0: the charged rungs go (back to the config before them) and the ladder moves on from
    the failure they answered, without them for the rest of the run."""
    names, before, unusable = "+".join(charged.rungs), charged.before, unusable_rungs(history)
    head = (
        f"{charged.kind.value} right after {names} changed the config (no attempt failed so before): "
        f"{names} reverted and unusable for this run"
    )
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
    for index, past in reversed(list(enumerate(history))):
        if past.steps_progressed > 0:
            break
        if index > 0 and history[index - 1].knobs != past.knobs:
            return streak + 1
        streak += 1
    return streak


def _retry_unchanged(kind: FailureKind, knobs: Knobs, history: Sequence[PastAttempt], limit: int) -> Decision:
    # Failures of ``kind`` with ``knobs`` back to (and including) the newest attempt that trained
    # steps: the ones before it were followed by training, so they were transient.
    same = 0
    for past in reversed(history):
        if past.kind is kind and past.knobs == knobs:
            same += 1
        if past.steps_progressed > 0:
            break
    if same >= max(2, limit):
        why = f"{kind.value} happened {same} times with the same config and no step trained in between"
        return GiveUp(f"{why}; no rung addresses it")
    why = f"{kind.value} may be transient: retry unchanged"
    return Restart(knobs, "retry_unchanged", {}, why, Survives.ALL)


# ---- rule 0: a rung charged with the failure right after it -------------------------------
# A failure the run did not have before a rung changed its config, with no step trained, is the
# rung's: the change is deterministic, so a retry repeats it (issue 19: cpu_offload -> meta tensors,
# three times). Every rung of a combination is charged (which one broke it cannot be told apart).
# Charges derive from the history alone, so a restarted supervisor reads the same from the journal.
CHARGEABLE = frozenset({FailureKind.OTHER, FailureKind.CONFIG_ERROR, FailureKind.BNB_CUDA_SETUP})
#: Where an OOM kind happened, for a past attempt journalled without its stage.
_STAGE_OF_KIND: Mapping[FailureKind, Stage] = {
    FailureKind(f"oom_{stage.value}"): stage
    for stage in (Stage.LOAD, Stage.FORWARD, Stage.BACKWARD, Stage.OPTIMIZER, Stage.EVAL, Stage.MERGE)
}


@dataclass(frozen=True)
class Charge:
    """Rungs charged with the newest failure, and the attempt before them (its failure to climb from)."""

    rungs: tuple[str, ...]
    kind: FailureKind  # the failure charged
    before: PastAttempt  # the attempt whose failure the rungs answered


@dataclass(frozen=True)
class PastFailure:
    """A failure as the ladder needs it (kind and stage): an earlier attempt's, or the merge's."""

    kind: FailureKind
    stage: Stage
    numbers: Mapping[str, Any] = field(default_factory=dict)
    fatal_xid: int | None = None

    @classmethod
    def of(cls, past: PastAttempt) -> PastFailure:
        assert past.kind is not None  # a Charge's ``before`` failed
        return cls(past.kind, past.stage or _STAGE_OF_KIND.get(past.kind, Stage.FORWARD))


def charge_at(history: Sequence[PastAttempt], index: int) -> Charge | None:
    """The charge of attempt ``history[index]``'s failure, or None when it is not a rung's."""
    failed = history[index]
    if index == 0 or failed.kind not in CHARGEABLE or failed.steps_progressed > 0:
        return None
    before = history[index - 1]
    if before.kind is None or not before.kind.is_oom or before.knobs == failed.knobs:
        return None  # no rung changed the config for a memory failure just before
    if any(past.kind is failed.kind for past in history[:index] if past.knobs != failed.knobs):
        return None  # the run had this failure before the change: it is not the rung's
    names = rungs.rungs_between(before.knobs, failed.knobs)
    return Charge(names, failed.kind, before) if names else None


def unusable_rungs(history: Sequence[PastAttempt]) -> frozenset[str]:
    """The rungs unusable for the rest of the run: charged with a failure in ``history``, or whose
    knob an attempt changed but its trainer did not take."""
    charged = {name for i in range(len(history)) if (c := charge_at(history, i)) for name in c.rungs}
    untaken = {knob for past in history for knob in past.unapplied}
    return frozenset(charged | {rung.name for rung in rungs.RUNGS if rung.knob in untaken})


# ---- rule 6a: a host OOM kill, and its ladder ---------------------------------------------
# On a shared host the OOM killer often picks the trainer for a neighbour's spike, so a kill after
# progress is retried unchanged, unless the retry got no further (the config's own peak) or offload
# is on (charged instead, :mod:`.choice`). The stage of a kill is only where the process was, not
# what grew: its ladder takes throughput rungs first (none that moves memory to the host), quality
# last, and the rank only for a kill in the optimizer stage before the first step.
_STEP_STAGES = frozenset({Stage.FORWARD, Stage.BACKWARD, Stage.OPTIMIZER})
#: Throughput rungs that shrink a training step's memory without moving anything to the host.
_STEP_RUNGS = ("gradient_checkpointing", "halve_micro_batch")
_RANK = "halve_lora_rank"
#: Rungs that move memory from the card to the host: no way down after the host killed the child.
_HOST_RUNGS = frozenset({"activation_offload", "paged_8bit_optimizer"})


def retry_after_kill(failure: FailureLike, knobs: Knobs, failed: Sequence[PastAttempt]) -> Restart | None:
    """Restart unchanged when ``failure`` is a host OOM kill after progress that is not in a row;
    ``failed``: the failed attempts, this one last. None: the ladder decides."""
    after_progress = failure.kind is FailureKind.HOST_OOM and bool(failed) and failed[-1].steps_progressed > 0
    if not after_progress or knobs.activation_offload:  # offload held the host's RAM: charged (choice.py)
        return None
    now, before = failed[-1], (failed[-2] if len(failed) > 1 else None)
    in_a_row = before is not None and before.kind is FailureKind.HOST_OOM and before.knobs == knobs
    if in_a_row and before is not None and now.reached <= before.reached:
        return None  # killed again no further than the last kill: the config's own peak
    why = (
        f"host OOM kill after {now.steps_progressed} step(s) of progress (at step {now.reached}): the "
        "config fitted until then and the kernel may have picked the trainer for another process's "
        "spike; retry unchanged before the ladder moves"
    )
    return Restart(knobs, "retry_unchanged", {}, why, Survives.ALL)


def host_settings(failure: FailureLike, settings: Settings, failed: Sequence[PastAttempt]) -> Settings:
    """``settings`` with the ladder for a host OOM at the failure's stage (above) as the ``host_oom``
    ladder; a job's own ``host_oom`` ladder is taken as written."""
    if failure.kind is not FailureKind.HOST_OOM or FailureKind.HOST_OOM in settings.overrides:
        return settings
    walked = ladder_for(FailureKind.HOST_OOM, failure.stage, settings.overrides)
    names = tuple(n for n in walked if n not in _HOST_RUNGS)
    if failure.stage in _STEP_STAGES:
        names = tuple(dict.fromkeys((*names, *_STEP_RUNGS)))
    grew = failure.stage is Stage.OPTIMIZER and bool(failed) and failed[-1].steps_progressed <= 0
    quality = [n for n in names if RUNG_CLASSES.get(n) is CostClass.QUALITY and (n != _RANK or grew)]
    ladder = (*(n for n in names if RUNG_CLASSES.get(n) is not CostClass.QUALITY), *quality)
    return dataclasses.replace(settings, overrides={**settings.overrides, FailureKind.HOST_OOM: ladder})


# ---- rule 6b: a spurious OOM, the same config retried once before any rung (issue 33) -----
# The classifier marks an OOM spurious when the allocator's own numbers say the request fit
# (supervisor/diagnosis/fragmentation.py); a repeat right after the retry, before any step, is the config's.
#: The key in a failure's numbers that marks it spurious: the bytes that were there for the request.
SPURIOUS_KEY = "spurious_room"
RETRY_RUNG = "retry_spurious"  # The rung name journalled for the retry.


def retry_spurious(failure: FailureLike, knobs: Knobs, failed: Sequence[PastAttempt]) -> Restart | None:
    """Restart unchanged when ``failure`` is marked spurious and ``knobs`` had no such retry yet;
    ``failed``: the failed attempts, this one last. None: the ladder decides."""
    if SPURIOUS_KEY not in failure.numbers or not failed:
        return None
    if any(past.rung == RETRY_RUNG and past.knobs == knobs for past in failed[:-1]):
        return None  # once per config (issue 33): the ladder takes a second spurious OOM
    before = failed[-2] if len(failed) > 1 else None
    again = before is not None and before.kind is failure.kind and before.knobs == knobs
    if again and failed[-1].steps_progressed <= 0:
        return None  # the retry was had and failed the same way at once: the config's own
    why = (
        f"{failure.kind.value} looks spurious (the allocator's numbers say the request fit: "
        f"{int(failure.numbers[SPURIOUS_KEY]) / 1024**2:.0f} MiB were there for it): retry the same "
        "config once before any rung"
    )
    return Restart(knobs, RETRY_RUNG, {}, why, Survives.ALL)


# ---- rules 4 and 5: waits, a GPU that faults, a card left out -----------------------------
def _contended(failure: FailureLike, knobs: Knobs, settings: Settings, waited: WaitResult | None) -> Decision:
    # What the failed process held plus what it asked for: the memory it needs to get past.
    numbers = failure.numbers
    held = numbers.get("process_in_use") or numbers.get("already_allocated") or 0
    needed = int(held) + int(numbers.get("tried_to_allocate") or 0)
    if waited is None:
        return Wait(settings.contention_wait_s, needed, "other processes hold the GPU memory this job needs")
    if waited.free_bytes is None:
        why = "no NVML reading to wait on: retry the same config after the backoff"
        return Restart(knobs, "wait_for_memory", {}, why, Survives.ALL)
    if waited.free_bytes >= needed:
        return Restart(knobs, "wait_for_memory", {}, "the other processes released the memory", Survives.ALL)
    kept = GiveUp(
        f"other processes kept the GPU memory for {settings.contention_wait_s:.0f}s "
        "and supervise.degrade_on_contention is false"
    )
    return without_card(failure, knobs, "other processes kept one card's memory") or kept


def without_card(failure: FailureLike, knobs: Knobs, why: str) -> Restart | None:
    """Under torchrun, the restart on the other cards (``drop_rank``) when one card keeps failing;
    None for a single process or where the effective batch cannot be kept exactly."""
    # A failure of the supervisor's (diagnosis.Failure) names the rank that caused it; one that
    # does not (a single process, a caller's own failure type) leaves the last card out.
    context = rungs.RungContext(failed_local_rank=getattr(failure, "local_rank", None))
    for rung in (rungs.rung_by_name(name, context) for name in rungs.CARD_FAILING):
        if (dropped := rung.apply(knobs)) is not None:
            changes = knob_changes(knobs, dropped)
            return Restart(dropped, rung.name, changes, f"{why}: {rung.reason}", rung.survives)
    return None


def _disk_full(failure: FailureLike, knobs: Knobs, settings: Settings, waited: WaitResult | None) -> Decision:
    needed = int(failure.numbers.get("needed_bytes") or 0)
    if waited is None:
        why = "the disk holding the run directory has no room for a checkpoint"
        return Wait(settings.disk_wait_s, needed, why, WaitFor.DISK)
    if waited.free_bytes is None or waited.free_bytes >= needed:
        return Restart(knobs, "wait_for_disk", {}, "there is room on the disk again", Survives.ALL)
    return GiveUp(
        f"the disk stayed without room for a checkpoint ({needed} bytes) for "
        f"{settings.disk_wait_s:.0f}s (supervise.disk_wait): free space there and run the same command again"
    )
