"""The decision after a failed attempt: ``Restart | Wait | GiveUp``, a value the loop carries out.

Order of the rules (first match wins):

1. a failure no config can fix (config error, bitsandbytes setup) -> GiveUp (not retryable)
2. the attempt budget is spent -> GiveUp
3. ``max_no_progress`` restarts in a row trained no step without any config change between
   them -> GiveUp (crash loop: the same thing failing again at once, e.g. memory that keeps
   being taken by another process, or a retried transient error that is not transient)
4. contention, the job does not allow degrading: no wait yet -> Wait(seconds, needed_bytes);
   after the loop reports the wait (:class:`WaitResult`): the memory came back, or NVML gave
   no reading to wait on -> Restart unchanged; the wait timed out -> GiveUp
4b. disk_full: no wait yet -> Wait(seconds, needed_bytes, for the disk); after the wait: room
   came back (or no reading) -> Restart unchanged; the wait timed out -> GiveUp. No rung
   changes what a checkpoint needs on disk, and a full disk says nothing about the config.
5. hang / nccl / other -> Restart unchanged; the same failure repeated ``max_no_progress`` times
   *with no step trained in between* -> GiveUp. Failures are counted by progress: an attempt that trained
   steps before it failed starts a fresh count, so a week-long run survives any number of
   preemptions or operator kills as long as each retry gets further (the crash-loop guard of
   rule 3 and ``max_attempts`` still bound it)
   A GPU fault: a fatal Xid -> GiveUp, not retryable (on that GPU); another -> as hang.
   Under torchrun (``world_size`` > 1) a card that keeps failing (a fatal Xid, a fault that
   came back, contention that outlasted the wait) -> Restart with ``drop_rank``: the other
   cards, accumulation raised so micro x accumulation x ranks holds (GiveUp as above when it
   cannot hold exactly)
6. OOM-like kinds -> walk the ladder: skip rungs with nothing to change, results that already
   failed the same way, and results a calibrated memory model says cannot fit (their change is
   kept and the next rung is applied on top) -> Restart, or GiveUp when the ladder is exhausted.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from qlora_supervise.policies import memory_model, preflight
from qlora_supervise.policies.ladders import CARD_FAILING, ladder_for
from qlora_supervise.policies.rungs import (
    STATIC_RUNGS,
    Rung,
    RungContext,
    Survives,
    rung_by_name,
    shorten_cost_text,
)
from qlora_supervise.trainer_child.contract.attempt_facts import SampleLengths
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage
from qlora_supervise.trainer_child.contract.spec import Knobs

NOT_RETRYABLE = frozenset({FailureKind.CONFIG_ERROR, FailureKind.BNB_CUDA_SETUP})
RETRY_UNCHANGED_ONCE = frozenset(
    {FailureKind.HANG, FailureKind.NCCL, FailureKind.OTHER, FailureKind.GPU_FAULT}
)
_SURVIVAL_ORDER = (Survives.ALL, Survives.OPTIMIZER_RESET, Survives.ADAPTER_REINIT)


class FailureLike(Protocol):
    """What the policy reads of a classified failure (the supervisor's ``Failure``)."""

    @property
    def kind(self) -> FailureKind: ...

    @property
    def stage(self) -> Stage: ...

    @property
    def numbers(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class PastAttempt:
    """One finished attempt as the policy sees it."""

    knobs: Knobs
    kind: FailureKind | None  # None: the attempt did not fail (stopped by the user)
    steps_progressed: int
    peak_bytes: int | None = None


@dataclass(frozen=True)
class Settings:
    """The job's supervise section, plus facts the policy needs about the model and budget."""

    max_attempts: int = 8
    max_no_progress: int = 3
    degrade_on_contention: bool = False
    contention_wait_s: float = 1800.0
    disk_wait_s: float = 1800.0
    fallbacks: tuple[str, ...] = ()
    overrides: Mapping[FailureKind, tuple[str, ...]] = field(default_factory=dict)
    budget_bytes: int | None = None
    shape: memory_model.ModelShape | None = None
    #: Peaks observed on this host in earlier runs of the same shape (the per-host store).
    prior: tuple[memory_model.Observation, ...] = ()
    # The latest attempt's tokenized sample lengths: shorten_seq_len says what it would cut.
    sample_lengths: SampleLengths | None = None


@dataclass(frozen=True)
class Restart:
    knobs: Knobs
    rung: str  # "+"-joined when the memory model made the policy apply several at once
    changes: Mapping[str, tuple[Any, Any]]
    why: str
    survives: Survives


class WaitFor(str, enum.Enum):
    """What a :class:`Wait` waits for."""

    GPU_MEMORY = "gpu_memory"  # other processes to release the card's memory
    DISK = "disk"  # room on the disk that holds the run directory


@dataclass(frozen=True)
class Wait:
    """Wait up to ``seconds`` for ``needed_bytes`` of GPU memory (or disk) to be free, then ask again."""

    seconds: float
    needed_bytes: int
    why: str
    resource: WaitFor = WaitFor.GPU_MEMORY


@dataclass(frozen=True)
class WaitResult:
    """What the loop saw while carrying out a :class:`Wait`: the last free reading (None: no reading)."""

    free_bytes: int | None
    waited_s: float
    stopped: bool = False  # a stop signal ended the wait: no verdict (the loop stops the run)


@dataclass(frozen=True)
class GiveUp:
    why: str
    retryable: bool = True  # False: no config change can help (exit 4 rather than 3)


Decision = Restart | Wait | GiveUp


def decide(
    failure: FailureLike,
    knobs: Knobs,
    history: Sequence[PastAttempt],
    settings: Settings,
    waited: WaitResult | None = None,
    phase: str = "train",
) -> Decision:
    """What to do after ``failure`` of an attempt that ran with ``knobs``.

    ``history`` holds every finished attempt, the failed one included (last); attempts that did
    not fail (stopped by the user, interrupted by a supervisor restart) count toward neither
    the attempt budget nor the crash-loop streak. In the ``merge`` phase every memory failure
    takes the merge ladder: training rungs cannot help a merge and a smaller model would merge
    the adapter onto the wrong base.
    """
    kind = failure.kind
    failed = [past for past in history if past.kind is not None]
    if kind is FailureKind.GPU_FAULT and failure.numbers.get("fatal_xid") is not None:
        return _without_card(failure, knobs, "the card reported a fatal Xid") or _gpu_broken(failure)
    if kind in NOT_RETRYABLE:
        return GiveUp(f"{kind.value} cannot be fixed by changing the training config", retryable=False)
    if len(failed) >= settings.max_attempts:
        return GiveUp(f"all {settings.max_attempts} attempts used (supervise.max_attempts)")
    if _no_progress_streak(failed) >= settings.max_no_progress:
        return GiveUp(
            f"{settings.max_no_progress} attempts in a row trained no step with the same config "
            "(crash loop); see attempts.jsonl"
        )
    if kind is FailureKind.OOM_CONTENTION and not settings.degrade_on_contention:
        return _after_contention(failure, knobs, settings, waited)
    if kind is FailureKind.DISK_FULL:
        return _after_disk_full(failure, knobs, settings, waited)
    if kind in RETRY_UNCHANGED_ONCE:
        # A GPU that faulted is retried once (issue 9); other transient kinds up to the crash-loop limit.
        limit = 2 if kind is FailureKind.GPU_FAULT else settings.max_no_progress
        retried = _retry_unchanged(kind, knobs, history, limit)
        if kind is FailureKind.GPU_FAULT and isinstance(retried, GiveUp):
            return _without_card(failure, knobs, "the card faulted again") or retried
        return retried
    if phase == "merge" and kind.is_oom:
        return _climb(_MergeFailure(), knobs, history, settings)
    return _climb(failure, knobs, history, settings)


def _gpu_broken(failure: FailureLike) -> GiveUp:
    """A fatal Xid: the GPU must be reset or replaced; no config, and no retry, helps on it."""
    code = failure.numbers["fatal_xid"]
    return GiveUp(
        f"the GPU reported fatal Xid {code}: it needs a reset (nvidia-smi -r) or a hardware check; "
        "nothing was retried on it (the checkpoints are kept)",
        retryable=False,
    )


def bytes_needed(numbers: Mapping[str, Any]) -> int:
    """What the failed process held plus what it asked for: the memory it needs to get past."""
    held = numbers.get("process_in_use") or numbers.get("already_allocated") or 0
    return int(held) + int(numbers.get("tried_to_allocate") or 0)


def _after_contention(
    failure: FailureLike, knobs: Knobs, settings: Settings, waited: WaitResult | None
) -> Decision:
    needed = bytes_needed(failure.numbers)
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
    return _without_card(failure, knobs, "other processes kept one card's memory") or kept


def _without_card(failure: FailureLike, knobs: Knobs, why: str) -> Restart | None:
    """Under torchrun, the restart on the other cards (``drop_rank``) when one card keeps failing;
    None for a single process or where the effective batch cannot be kept exactly."""
    # A failure of the supervisor's (diagnosis.Failure) names the rank that caused it; one that
    # does not (a single process, a caller's own failure type) leaves the last card out.
    context = RungContext(failed_local_rank=getattr(failure, "local_rank", None))
    for rung in (rung_by_name(name, context) for name in CARD_FAILING):
        dropped = rung.apply(knobs)
        if dropped is not None:
            changes = knob_changes(knobs, dropped)
            return Restart(dropped, rung.name, changes, f"{why}: {rung.reason}", rung.survives)
    return None


def _after_disk_full(
    failure: FailureLike, knobs: Knobs, settings: Settings, waited: WaitResult | None
) -> Decision:
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


@dataclass(frozen=True)
class _MergeFailure:
    """How the ladder sees any memory failure of the merge process."""

    kind: FailureKind = FailureKind.OOM_MERGE
    stage: Stage = Stage.MERGE
    numbers: Mapping[str, Any] = field(default_factory=dict)


def _no_progress_streak(history: Sequence[PastAttempt]) -> int:
    """Attempts at the end of the history that trained no step and ran the config of the one before.

    A ladder climbing at step 0 changes the config every time and ends on its own (finitely
    many rungs, no config repeated), so only unchanged restarts count toward a crash loop. The
    first attempt of the streak counts too: it is the failure the unchanged restarts repeat.
    """
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
    # A kill can come again before the retry trains a step (a preemption during the next load):
    # the same failure gives up only once it repeated ``limit`` times (the crash-loop limit,
    # supervise.max_no_progress_attempts) with no step trained in between.
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
    """Failures of ``kind`` with ``knobs`` back to (and including) the newest attempt that trained steps.

    The count starts afresh at an attempt that made progress: that failure is the first of a
    new count, and the ones before it were followed by training, so they were transient.
    """
    same = 0
    for past in reversed(history):
        if past.kind is kind and past.knobs == knobs:
            same += 1
        if past.steps_progressed > 0:
            break
    return same


def _climb(
    failure: FailureLike, knobs: Knobs, history: Sequence[PastAttempt], settings: Settings
) -> Decision:
    failed_same_way = {past.knobs for past in history if past.kind is failure.kind}
    scale = _scale(history, settings)
    searched = _search(failure, knobs, failed_same_way, settings, scale)
    if searched is not None:
        return searched
    context = RungContext(settings.fallbacks, getattr(failure, "local_rank", None))
    candidate = knobs
    applied: list[Rung] = []
    skipped: list[str] = []
    for name in ladder_for(failure.kind, failure.stage, settings.overrides):
        rung = rung_by_name(name, context)
        changed = rung.apply(candidate)
        if changed is None or changed in failed_same_way:
            continue
        candidate = changed
        applied.append(rung)
        if not _predicted_too_big(candidate, settings, scale):
            return _restart(knobs, candidate, applied, skipped, settings.sample_lengths)
        skipped.append(rung.name)
    if applied:
        # Nothing fits by the model's estimate: it may be wrong, so take one step, not all.
        first = applied[0]
        stepped = first.apply(knobs)
        assert stepped is not None  # it changed these knobs in the walk above
        return _restart(knobs, stepped, [first], [], settings.sample_lengths)
    return GiveUp(f"ladder for {failure.kind.value} exhausted: no rung changes this config any further")


#: Kinds whose memory is the training step's, which the memory model predicts (not load, eval, merge).
_STEP_MEMORY = frozenset(
    {
        FailureKind.OOM_FORWARD,
        FailureKind.OOM_BACKWARD,
        FailureKind.OOM_OPTIMIZER,
        FailureKind.OOM_FRAGMENTATION,
    }
)
#: Which rung a knob change of the search stands for, in the journal's words.
_RUNG_OF_KNOB = {
    "gradient_checkpointing": "gradient_checkpointing",
    "micro_batch_size": "halve_micro_batch",
    "optimizer": "paged_8bit_optimizer",
    "expandable_segments": "expandable_segments",
}


def _search(
    failure: FailureLike, knobs: Knobs, failed: set[Knobs], settings: Settings, scale: float | None
) -> Restart | None:
    """The cheapest throughput-only change predicted to fit, searched over combinations.

    The ladder applies each rung once in its order; the search can combine them (checkpointing
    with the micro-batch halved twice) and so reaches a config that fits without the quality
    rung a walk would take next. The failure itself calibrates it: the failed config needed
    more than the budget, so the model's variable part is scaled up to say so at least. A
    quality change, or nothing predicted to fit, leaves the choice to the ladder walk.
    """
    shape, budget = settings.shape, settings.budget_bytes
    if shape is None or budget is None or failure.kind not in _STEP_MEMORY:
        return None
    floor = _failed_scale(shape, knobs, budget)
    result = preflight.preflight(shape, knobs, budget, scale=max(scale or floor, floor))
    if not result.fits or result.quality_changed or result.knobs == knobs or result.knobs in failed:
        return None
    changed = {_RUNG_OF_KNOB[name] for name in result.changes if name in _RUNG_OF_KNOB}
    names = [name for name in STATIC_RUNGS if name in changed]  # the rungs' own order
    survives = Survives.OPTIMIZER_RESET if "optimizer" in result.changes else Survives.ALL
    why = "; ".join(STATIC_RUNGS[name].reason for name in names)
    why += f" (memory model: {result.reasons[-1]})"
    return Restart(result.knobs, "+".join(names), knob_changes(knobs, result.knobs), why, survives)


def _failed_scale(shape: memory_model.ModelShape, knobs: Knobs, budget: int) -> float:
    """The smallest scale of the variable part at which ``knobs`` no longer fits ``budget``."""
    fixed, variable = memory_model.split(memory_model.predict(shape, knobs))
    return max(1.0, (budget - fixed) / variable) if variable > 0 else 1.0


def _scale(history: Sequence[PastAttempt], settings: Settings) -> float | None:
    if settings.shape is None:
        return None
    observations = [
        memory_model.Observation(past.knobs, past.peak_bytes)
        for past in history
        # A peak counts once the attempt finished a whole optimizer step with those knobs.
        if past.steps_progressed > 0 and past.peak_bytes
    ]
    # This run's own peaks first: with any of them, the host's older ones are not needed.
    return memory_model.calibrate(settings.shape, observations or list(settings.prior))


def _predicted_too_big(knobs: Knobs, settings: Settings, scale: float | None) -> bool:
    if settings.shape is None or settings.budget_bytes is None:
        return False
    return memory_model.cannot_fit(settings.shape, knobs, settings.budget_bytes, scale)


def _restart(
    old: Knobs, new: Knobs, applied: list[Rung], skipped: list[str], lengths: SampleLengths | None
) -> Restart:
    why = "; ".join(_reason(rung, old, new, lengths) for rung in applied)
    if skipped:
        why += f" (memory model: {', '.join(skipped)} alone would not fit)"
    survives = max((rung.survives for rung in applied), key=_SURVIVAL_ORDER.index)
    return Restart(new, "+".join(rung.name for rung in applied), knob_changes(old, new), why, survives)


def _reason(rung: Rung, old: Knobs, new: Knobs, lengths: SampleLengths | None) -> str:
    """The rung's reason, with what it costs where that is known (the samples a shorter seq_len cuts)."""
    if rung.name == "shorten_seq_len" and lengths is not None:
        return f"{rung.reason}: {shorten_cost_text(lengths, old, new)}"
    return rung.reason


def knob_changes(old: Knobs, new: Knobs) -> dict[str, tuple[Any, Any]]:
    """``{knob: (old, new)}`` for every knob that differs."""
    before, after = dataclasses.asdict(old), dataclasses.asdict(new)
    return {name: (before[name], after[name]) for name in before if before[name] != after[name]}
