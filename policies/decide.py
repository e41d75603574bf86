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
5. hang / nccl / other -> Restart unchanged once; the same failure again -> GiveUp;
   a GPU fault: a fatal Xid -> GiveUp, not retryable (on that GPU); another -> as hang
6. OOM-like kinds -> walk the ladder: skip rungs with nothing to change, results that already
   failed the same way, and results a calibrated memory model says cannot fit (their change is
   kept and the next rung is applied on top) -> Restart, or GiveUp when the ladder is exhausted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from qlora_supervise.policies import memory_model
from qlora_supervise.policies.ladders import ladder_for
from qlora_supervise.policies.rungs import Rung, RungContext, Survives, rung_by_name
from qlora_supervise.trainer_child.protocol import FailureKind, Knobs, Stage

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
    fallbacks: tuple[str, ...] = ()
    overrides: Mapping[FailureKind, tuple[str, ...]] = field(default_factory=dict)
    budget_bytes: int | None = None
    shape: memory_model.ModelShape | None = None


@dataclass(frozen=True)
class Restart:
    knobs: Knobs
    rung: str  # "+"-joined when the memory model made the policy apply several at once
    changes: Mapping[str, tuple[Any, Any]]
    why: str
    survives: Survives


@dataclass(frozen=True)
class Wait:
    """Wait up to ``seconds`` for ``needed_bytes`` of GPU memory to be free, then ask again."""

    seconds: float
    needed_bytes: int
    why: str


@dataclass(frozen=True)
class WaitResult:
    """What the loop saw while carrying out a :class:`Wait`: the last free reading (None: no NVML)."""

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
        return _gpu_broken(failure)
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
    if kind in RETRY_UNCHANGED_ONCE:
        return _retry_unchanged(kind, knobs, history)
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
    return GiveUp(
        f"other processes kept the GPU memory for {settings.contention_wait_s:.0f}s "
        "and supervise.degrade_on_contention is false"
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


def _retry_unchanged(kind: FailureKind, knobs: Knobs, history: Sequence[PastAttempt]) -> Decision:
    same = sum(1 for past in history if past.kind is kind and past.knobs == knobs)
    if same > 1:
        return GiveUp(f"{kind.value} happened again with the same config; no rung addresses it")
    return Restart(knobs, "retry_unchanged", {}, f"{kind.value} may be transient: retry once", Survives.ALL)


def _climb(
    failure: FailureLike, knobs: Knobs, history: Sequence[PastAttempt], settings: Settings
) -> Decision:
    failed_same_way = {past.knobs for past in history if past.kind is failure.kind}
    scale = _scale(history, settings)
    context = RungContext(fallbacks=settings.fallbacks)
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
            return _restart(knobs, candidate, applied, skipped)
        skipped.append(rung.name)
    if applied:
        # Nothing fits by the model's estimate: it may be wrong, so take one step, not all.
        first = applied[0]
        stepped = first.apply(knobs)
        assert stepped is not None  # it changed these knobs in the walk above
        return _restart(knobs, stepped, [first], [])
    return GiveUp(f"ladder for {failure.kind.value} exhausted: no rung changes this config any further")


def _scale(history: Sequence[PastAttempt], settings: Settings) -> float | None:
    if settings.shape is None:
        return None
    observations = [
        memory_model.Observation(past.knobs, past.peak_bytes)
        for past in history
        # A peak counts once the attempt finished a whole optimizer step with those knobs.
        if past.steps_progressed > 0 and past.peak_bytes
    ]
    return memory_model.calibrate(settings.shape, observations)


def _predicted_too_big(knobs: Knobs, settings: Settings, scale: float | None) -> bool:
    if settings.shape is None or settings.budget_bytes is None:
        return False
    return memory_model.cannot_fit(settings.shape, knobs, settings.budget_bytes, scale)


def _restart(old: Knobs, new: Knobs, applied: list[Rung], skipped: list[str]) -> Restart:
    why = "; ".join(rung.reason for rung in applied)
    if skipped:
        why += f" (memory model: {', '.join(skipped)} alone would not fit)"
    survives = max((rung.survives for rung in applied), key=_SURVIVAL_ORDER.index)
    return Restart(new, "+".join(rung.name for rung in applied), knob_changes(old, new), why, survives)


def knob_changes(old: Knobs, new: Knobs) -> dict[str, tuple[Any, Any]]:
    """``{knob: (old, new)}`` for every knob that differs."""
    before, after = dataclasses.asdict(old), dataclasses.asdict(new)
    return {name: (before[name], after[name]) for name in before if before[name] != after[name]}
