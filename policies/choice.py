"""The one place that decides the config: at the first plan, after a failure, after the speed trial.
Only this module calls the search (:mod:`.search.config_search`) and the ladder walk
(:mod:`.ladder.climb`), a contract in pyproject checks it; each answer carries its reason, which
the journal keeps and ``explain`` prints (docs/how-it-works.md tells the three moments); and
whether to time the speed trial again when the card's sharing has changed (:func:`retime`)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from qlora_supervise.policies.ladder import climb
from qlora_supervise.policies.rungs import RUNG_BY_NAME, Survives, knob_changes, rungs_between
from qlora_supervise.policies.search import config_search, throughput
from qlora_supervise.policies.search.search_state import PreflightResult, gib
from qlora_supervise.policies.verdicts import Decision, FailureLike, PastAttempt, Restart, Settings, for_model
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.events import TrialResult
from qlora_supervise.trainer_child.contract.spec import Knobs, TrialCandidate

#: Attempt 1's config: the search itself (``run``'s first plan and the ``plan`` command ask it here).
first = config_search.preflight
#: A candidate replaces the planned config only when it is this much faster: below, noise decides.
MIN_GAIN = 0.05
#: What a trial candidate sets: the knobs that change without a reload.
TRIAL_KNOBS = ("micro_batch_size", "grad_accum", "gradient_checkpointing")
#: Kinds whose memory is the training step's, which the memory model predicts (not load, eval, merge).
_STEP_MEMORY = frozenset(
    map(FailureKind, ("oom_forward", "oom_backward", "oom_optimizer", "oom_fragmentation"))
)


def after_failure(
    failure: FailureLike,
    knobs: Knobs,
    history: Sequence[PastAttempt],
    settings: Settings,
    unusable: frozenset[str] = frozenset(),
) -> Decision:
    """The next config after a memory ``failure`` of ``knobs`` (rule 6 of :mod:`.decide`): offload
    charged after a host OOM kill under it, else the search again from the failed config, else the
    ladder walk; ``unusable``: rungs charged with a failure (``settings.cannot_take`` added)."""
    settings = for_model(settings, knobs.model)
    unusable = unusable | settings.cannot_take
    failed = frozenset(past.knobs for past in history if past.kind is failure.kind)
    scale = climb.calibrated_scale(history, settings)
    offloaded = failure.kind is FailureKind.HOST_OOM and knobs.activation_offload
    if offloaded and (charged := _charge_offload(knobs, failed, settings, scale, unusable)) is not None:
        return charged
    # The fastest throughput-only change predicted to fit, searched over combinations (a walk takes
    # one rung at a time, and a quality rung sooner); the failure calibrates the model: the failed
    # config needed more than the budget. A quality change or nothing that fits: the walk.
    shape, budget = settings.shape, settings.budget_bytes
    if shape is not None and budget is not None and failure.kind in _STEP_MEMORY:
        floor = climb.failed_scale(shape, knobs, budget, settings.targets)
        result = _again(settings, knobs, max(scale or floor, floor), failed, unusable)
        if result.fits and not result.quality_changed and result.knobs != knobs:
            names = rungs_between(knobs, result.knobs)
            why = "; ".join(RUNG_BY_NAME[name].reason for name in names)
            return _restart(knobs, result, "+".join(names), f"{why} (memory model: {result.reasons[-1]})")
    return climb.walk(failure, knobs, failed, settings, scale, unusable)


def _again(
    settings: Settings, knobs: Knobs, scale: float | None, failed: frozenset[Knobs], unusable: frozenset[str]
) -> PreflightResult:
    """The search again from ``knobs``, with this run's measured speeds (a shape and budget given)."""
    assert settings.shape is not None and settings.budget_bytes is not None
    shape = settings.shape
    speed = throughput.calibrate(shape, settings.speeds, settings.targets) if settings.speeds else None
    return first(
        shape, knobs, settings.budget_bytes, scale=scale, speed=speed,
        exclude=failed, unusable=unusable, host=settings.host, targets=settings.targets,
    )  # fmt: skip


def _restart(knobs: Knobs, result: PreflightResult, rung: str, why: str) -> Restart:
    survives = Survives.OPTIMIZER_RESET if "optimizer" in result.changes else Survives.ALL
    return Restart(result.knobs, rung, knob_changes(knobs, result.knobs), why, survives)


def _charge_offload(
    knobs: Knobs, failed: frozenset[Knobs], settings: Settings, scale: float | None, unusable: frozenset[str]
) -> Restart | None:
    """After a host OOM kill under offload: offload off with the fastest throughput-only config that fits
    card and host, else offload kept with less host need (no shape or budget: offload off); None: neither."""
    off = dataclasses.replace(knobs, activation_offload=False)
    why = "host OOM kill under activation offload: offload held the host's RAM, so it is charged with it"
    shape, budget = settings.shape, settings.budget_bytes
    if shape is None or budget is None:
        changes = knob_changes(knobs, off)
        return Restart(off, "activation_offload_off", changes, f"{why}; offload off", Survives.ALL)
    killed = climb.train_host(shape, knobs, settings)
    for base, banned in ((off, frozenset({"activation_offload"})), (knobs, frozenset())):
        result = _again(settings, base, scale, failed, unusable | banned)
        offloads = result.knobs.activation_offload
        lighter = not offloads or climb.train_host(shape, result.knobs, settings) < killed
        if result.fits and not result.quality_changed and result.fallback is None and lighter:
            names = ["activation_offload_off" if not offloads else ""]
            names += [n for n in rungs_between(off, result.knobs) if n != "activation_offload"]
            chose = result.reasons[-1] if result.reasons else "fits both budgets"
            return _restart(knobs, result, "+".join(n for n in names if n), f"{why}; {chose}")
    return None


@dataclasses.dataclass(frozen=True)
class TrialChoice:
    """What the speed trial's timings decide: the knobs to train with, and why."""

    knobs: Knobs
    switched: bool  # not the planned config
    why: str


def after_trial(planned: Knobs, results: Sequence[TrialResult]) -> TrialChoice:
    """The config to train with after the trial timed ``results`` (the first is ``planned``): the plan
    unless another ran more than :data:`MIN_GAIN` faster, or the plan failed (an OOM, or a peak over
    its limit) and another ran within it. The child calls it to switch in-process, the supervisor
    on the reported timings to journal what trained."""
    if not (ran := [r for r in results if r.tokens_per_s and r.error is None]):
        why = "no candidate ran within the plan's limit" if results else "nothing was timed"
        return TrialChoice(planned, False, f"speed trial: {why}; the plan stays")
    fastest, plan = max(ran, key=lambda r: r.tokens_per_s or 0.0), results[0]
    if plan not in ran:
        why = f"the plan failed in the trial ({plan.error or 'out of memory'}); the fastest that ran"
    elif (gain := (fastest.tokens_per_s or 0.0) / (plan.tokens_per_s or 1.0) - 1) > MIN_GAIN:
        why = f"measured {gain:.0%} faster than the plan (more than {MIN_GAIN:.0%})"
    else:
        why = f"speed trial: none measured over {MIN_GAIN:.0%} faster; the plan stays"
        return TrialChoice(planned, False, why)
    c = fastest.candidate
    why = f"speed trial: {c.name} at {fastest.tokens_per_s:.0f} tokens/s, {why}"
    return TrialChoice(trained_with(planned, c), True, why)


def within(result: TrialResult, limit: int | None) -> TrialResult:
    """``result``, or the same marked dropped when it measured above ``limit``: the pre-flight would
    not have planned a config it knew peaked there (H200: predicted 10.0 GiB, measured 11.6 of 12)."""
    if limit is None or result.peak_bytes is None or result.error is not None or result.peak_bytes <= limit:
        return result
    why = f"measured peak {gib(result.peak_bytes)} is over the plan's limit {gib(limit)}"
    return dataclasses.replace(result, error=why)


def trained_with(knobs: Knobs, candidate: TrialCandidate) -> Knobs:
    """``knobs`` switched to a trial candidate: what changes without a reload."""
    return dataclasses.replace(knobs, **{name: getattr(candidate, name) for name in TRIAL_KNOBS})


# Timing the speed trial again when the card's sharing has changed since it ran (issue 34): when
# the others' memory or SM use (NVML) has differed from the trial's for the whole settle time, and a
# candidate is predicted at least ``MIN_GAIN`` faster than the one trained by more than
# :data:`RESTART_COST_S` on the time left, the next checkpoint restarts with it to time the trial
# again (docs/ladder.md: beside three jobs on an H200 a trial chose micro 2, wrong once they left).

RETIME_RUNG = "retime"
#: How far the others' memory, or their SM utilisation (percentage points), must move to count.
SHARING_CHANGE_BYTES = 2 << 30
SHARING_CHANGE_UTIL = 30
#: What a planned restart costs in training time: the warm spare's start, the resume, the trial.
RESTART_COST_S = 60.0


@dataclasses.dataclass(frozen=True)
class Sharing:
    """What the other processes on the card held (bytes) and used (SM percent; None: not reported)."""

    others_bytes: int
    others_sm_util: int | None = None

    def differs(self, other: Sharing) -> bool:
        mine, theirs = self.others_sm_util, other.others_sm_util
        util = mine is not None and theirs is not None and abs(mine - theirs) >= SHARING_CHANGE_UTIL
        return abs(self.others_bytes - other.others_bytes) >= SHARING_CHANGE_BYTES or util

    def text(self) -> str:
        util = f", {self.others_sm_util} % of the SMs" if self.others_sm_util is not None else ""
        return f"{self.others_bytes / (1 << 30):.1f} GiB{util}"


@dataclasses.dataclass(frozen=True)
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
    if then is None or not window or held_for_s < settle_s or not all(now.differs(then) for now in window):
        return None
    # The candidate ``knobs`` trains, when they differ from the pre-flight's only in the trial's knobs.
    trained = next((c for c in first.candidates if trained_with(first.knobs, c) == knobs), None)
    if trained is None:
        return None  # the run has changed more than the trial's knobs since: its candidates are stale
    planned = max(first.candidates, key=lambda c: c.predicted_tokens_per_s or 0.0)
    fast, slow = planned.predicted_tokens_per_s, trained.predicted_tokens_per_s
    if not fast or not slow or fast < slow * (1 + MIN_GAIN):
        return None
    if remaining_s * (1 - slow / fast) <= RESTART_COST_S:  # what it saves on the time left
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
