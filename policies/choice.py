"""The one place that decides the config: at the first plan, after a failure, after the speed trial.

Only this module calls the search (:mod:`.search.config_search`) and the ladder walk
(:mod:`.ladder.climb`) (a contract in pyproject checks it); each answer carries its reason, which the
journal keeps and ``explain`` prints.

* **First plan** (:data:`first`): the search. The job as written when it is predicted to fit;
  otherwise every fitting combination of the free and throughput rungs, ranked by the throughput
  model, the fastest first; quality rungs only when none fits; then the fallback models.
* **After a memory failure** (:func:`after_failure`, rule 6 of :mod:`.decide`), first match wins:
  a host OOM kill under activation offload charges offload (the search again without it, or with
  less host need); a failure of the training step's own memory runs the search again from the
  failed config, the failure scaling the memory model up; when neither finds a throughput-only
  change that fits, the stage's ladder walks (quality rungs included).
* **After the speed trial** (:func:`after_trial`): the child times the search's top candidates
  before step 1 and reports their timings; the plan stays unless another measured more than
  :data:`MIN_GAIN` faster, or the plan itself failed in the trial. The child calls it to switch
  in-process (no restart), the supervisor calls it on the reported timings to journal what trained.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from qlora_supervise.policies.ladder import climb
from qlora_supervise.policies.rungs import RUNG_BY_NAME, Survives
from qlora_supervise.policies.search import config_search, throughput
from qlora_supervise.policies.search.candidates import rungs_between
from qlora_supervise.policies.search.search_result import knob_changes
from qlora_supervise.policies.verdicts import Decision, FailureLike, PastAttempt, Restart, Settings, for_model
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.events import TrialResult
from qlora_supervise.trainer_child.contract.spec import Knobs, TrialCandidate

#: Attempt 1's config: the search itself (``run``'s first plan and the ``plan`` command ask it here).
first = config_search.preflight

#: A candidate replaces the planned config only when it is this much faster (DeepSpeed's
#: autotuner also keeps the first config within noise); below it the trial's noise decides.
MIN_GAIN = 0.05

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
    """The next config after ``failure`` of ``knobs``; ``unusable``: rungs charged with a failure
    (the ones the trainer cannot take, ``settings.cannot_take``, are added)."""
    settings = for_model(settings, knobs.model)
    unusable = unusable | settings.cannot_take
    failed = frozenset(past.knobs for past in history if past.kind is failure.kind)
    scale = climb.calibrated_scale(history, settings)
    if failure.kind is FailureKind.HOST_OOM and knobs.activation_offload:
        charged = _charge_offload(knobs, failed, settings, scale, unusable)
        if charged is not None:
            return charged
    searched = _search(failure, knobs, failed, settings, scale, unusable)
    return searched or climb.walk(failure, knobs, failed, settings, scale, unusable)


def _search(
    failure: FailureLike,
    knobs: Knobs,
    failed: frozenset[Knobs],
    settings: Settings,
    scale: float | None,
    unusable: frozenset[str],
) -> Restart | None:
    """The fastest throughput-only change predicted to fit, searched over combinations.

    The ladder applies each rung once in its order; the search can combine them (checkpointing
    with the micro-batch halved twice) and so reaches a config that fits without the quality
    rung a walk would take next, ranked by the throughput model with this run's measured speeds.
    The failure itself calibrates it: the failed config needed more than the budget, so the
    model's variable part is scaled up to say so at least. A quality change, or nothing
    predicted to fit, leaves the choice to the ladder walk.
    """
    shape, budget = settings.shape, settings.budget_bytes
    if shape is None or budget is None or failure.kind not in _STEP_MEMORY:
        return None
    floor = climb.failed_scale(shape, knobs, budget, settings.targets)
    speed = throughput.calibrate(shape, settings.speeds, settings.targets) if settings.speeds else None
    result = first(
        shape, knobs, budget, scale=max(scale or floor, floor), speed=speed,
        exclude=failed, unusable=unusable, host=settings.host, targets=settings.targets,
    )  # fmt: skip
    if not result.fits or result.quality_changed or result.knobs == knobs:
        return None
    names = rungs_between(knobs, result.knobs)
    survives = Survives.OPTIMIZER_RESET if "optimizer" in result.changes else Survives.ALL
    why = "; ".join(RUNG_BY_NAME[name].reason for name in names)
    why += f" (memory model: {result.reasons[-1]})"
    return Restart(result.knobs, "+".join(names), knob_changes(knobs, result.knobs), why, survives)


def _charge_offload(
    knobs: Knobs, failed: frozenset[Knobs], settings: Settings, scale: float | None, unusable: frozenset[str]
) -> Restart | None:
    """After a host OOM kill under activation offload: offload off, and the fastest throughput-only
    config that fits the card and the host; else offload kept with less host need; None: neither
    (the ladder walks). Without a shape or card budget to search with, offload off alone."""
    off = dataclasses.replace(knobs, activation_offload=False)
    why = "host OOM kill under activation offload: offload held the host's RAM, so it is charged with it"
    shape, budget = settings.shape, settings.budget_bytes
    if shape is None or budget is None:
        return Restart(
            off, "activation_offload_off", knob_changes(knobs, off), f"{why}; offload off", Survives.ALL
        )
    speed = throughput.calibrate(shape, settings.speeds, settings.targets) if settings.speeds else None
    killed = climb.train_host(shape, knobs, settings)
    for base, banned in ((off, frozenset({"activation_offload"})), (knobs, frozenset())):
        result = first(
            shape, base, budget, scale=scale, speed=speed, exclude=failed,
            unusable=unusable | banned, host=settings.host, targets=settings.targets,
        )  # fmt: skip
        lighter = (
            not result.knobs.activation_offload or climb.train_host(shape, result.knobs, settings) < killed
        )
        if result.fits and not result.quality_changed and result.fallback is None and lighter:
            names = ["activation_offload_off" if not result.knobs.activation_offload else ""]
            names += [n for n in rungs_between(off, result.knobs) if n != "activation_offload"]
            rung = "+".join(n for n in names if n)
            survives = Survives.OPTIMIZER_RESET if "optimizer" in result.changes else Survives.ALL
            chose = result.reasons[-1] if result.reasons else "fits both budgets"
            return Restart(result.knobs, rung, knob_changes(knobs, result.knobs), f"{why}; {chose}", survives)
    return None


@dataclasses.dataclass(frozen=True)
class TrialChoice:
    """What the speed trial's timings decide: the knobs to train with, and why."""

    knobs: Knobs
    switched: bool  # not the planned config
    why: str


def after_trial(planned: Knobs, results: Sequence[TrialResult]) -> TrialChoice:
    """The config to train with after the trial timed ``results`` (the first is ``planned``): the plan
    unless another ran more than :data:`MIN_GAIN` faster. A plan that failed (an OOM, or a peak over
    the plan's limit: its ``error``) gives way to the fastest that ran within it; when none did, the
    plan stays (training then fails as it would have without a trial, and the ladder acts)."""
    ran = [r for r in results if r.tokens_per_s and r.error is None]
    if not ran:
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
    return TrialChoice(
        trained_with(planned, c), True, f"speed trial: {c.name} at {fastest.tokens_per_s:.0f} tokens/s, {why}"
    )


def within(result: TrialResult, limit: int | None) -> TrialResult:
    """``result``, or the same marked dropped when it measured above ``limit``: the pre-flight would
    not have planned a config it knew peaked there (on the H200 a calibrated plan once predicted
    10.0 GiB for a config the trial measured at 11.6 under a 12 GiB cap: 4 % from an OOM)."""
    if limit is None or result.peak_bytes is None or result.error is not None or result.peak_bytes <= limit:
        return result
    gib = 1 << 30
    why = f"measured peak {result.peak_bytes / gib:.2f} GiB is over the plan's limit {limit / gib:.2f} GiB"
    return dataclasses.replace(result, error=why)


def trained_with(knobs: Knobs, candidate: TrialCandidate) -> Knobs:
    """``knobs`` switched to a trial candidate: what changes without a reload."""
    return dataclasses.replace(
        knobs,
        micro_batch_size=candidate.micro_batch_size,
        grad_accum=candidate.grad_accum,
        gradient_checkpointing=candidate.gradient_checkpointing,
    )
