"""Rule 6 of the decision: after a memory failure, climb the ladder (or search its combinations).

Rungs with nothing to change, results that already failed the same way, rungs charged with a
failure earlier in the run (:mod:`.charge`), rungs the trainer cannot take (a foreign tool's
config has no key for them: ``Settings.cannot_take``), and results a calibrated memory model
says cannot fit are skipped (a skipped rung's change is kept and the next rung applied on top)
-> Restart, or GiveUp when the ladder is exhausted. For the training step's own memory the pre-flight's
search runs first: it combines throughput rungs and ranks them by the throughput model.

A host OOM kill is charged to what used the host (issue 28): under activation offload, offload
itself. Offload goes off and the fastest config that fits both budgets (the card's and the
host's) starts; where nothing without offload fits the card, offload stays with the config whose
host need is the smallest below the one that was killed. Only when no throughput config fits both
does the stage's ladder walk (and its quality rungs) decide. That walk, after a host OOM kill,
skips any rung that needs more host RAM than the killed config; after any failure, a result over
the host budget counts as too big, as the pre-flight counts it, and is never the one step taken
when nothing is predicted to fit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qlora_supervise.policies import memory_model
from qlora_supervise.policies.ladder.ladders import ladder_for
from qlora_supervise.policies.memory.host import host_train_need
from qlora_supervise.policies.rungs import (
    RUNG_BY_NAME,
    Rung,
    RungContext,
    Survives,
    rung_by_name,
    shorten_cost_text,
)
from qlora_supervise.policies.search import config_search as preflight
from qlora_supervise.policies.search import throughput
from qlora_supervise.policies.search.candidates import rungs_between
from qlora_supervise.policies.search.search_result import knob_changes
from qlora_supervise.policies.verdicts import Decision, FailureLike, GiveUp, PastAttempt, Restart, Settings
from qlora_supervise.trainer_child.contract.attempt_facts import SampleLengths
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage
from qlora_supervise.trainer_child.contract.spec import Knobs

_SURVIVAL_ORDER = (Survives.ALL, Survives.OPTIMIZER_RESET, Survives.ADAPTER_REINIT)


@dataclass(frozen=True)
class MergeFailure:
    """How the ladder sees any memory failure of the merge process."""

    kind: FailureKind = FailureKind.OOM_MERGE
    stage: Stage = Stage.MERGE
    numbers: Mapping[str, Any] = field(default_factory=dict)
    fatal_xid: int | None = None


def climb(
    failure: FailureLike,
    knobs: Knobs,
    history: Sequence[PastAttempt],
    settings: Settings,
    unusable: frozenset[str] = frozenset(),
) -> Decision:
    """The next rung(s) for ``failure`` of ``knobs``; ``unusable``: rungs charged with a failure
    (the ones the trainer cannot take, ``settings.cannot_take``, are added)."""
    settings = for_model(settings, knobs.model)
    unusable = unusable | settings.cannot_take
    failed_same_way = {past.knobs for past in history if past.kind is failure.kind}
    scale = _scale(history, settings)
    if failure.kind is FailureKind.HOST_OOM and knobs.activation_offload:
        charged = _charge_offload(knobs, failed_same_way, settings, scale, unusable)
        if charged is not None:
            return charged
    searched = _search(failure, knobs, failed_same_way, settings, scale, unusable)
    if searched is not None:
        return searched
    context = RungContext(settings.fallbacks, getattr(failure, "local_rank", None))
    candidate = knobs
    applied: list[Rung] = []
    skipped: list[str] = []
    for name in ladder_for(failure.kind, failure.stage, settings.overrides):
        if name in unusable:
            continue
        rung = rung_by_name(name, context)
        changed = rung.apply(candidate)
        if changed is None or changed in failed_same_way:
            continue
        if failure.kind is FailureKind.HOST_OOM and _adds_host(knobs, changed, settings):
            continue  # after a host OOM kill, a rung that adds host memory (offload) is no way down
        candidate = changed
        applied.append(rung)
        if not _predicted_too_big(candidate, settings, scale):
            return _restart(knobs, candidate, applied, skipped, settings.sample_lengths)
        skipped.append(rung.name)
    # Nothing fits by the model's estimate: it may be wrong, so take one step, not all; but not one
    # over the host budget (the pre-flight refuses those outright: a host OOM kill loses the step).
    for rung in applied:
        stepped = rung.apply(knobs)
        if stepped is not None and not _over_host(stepped, settings):
            return _restart(knobs, stepped, [rung], [], settings.sample_lengths)
    if applied:
        return GiveUp(
            f"ladder for {failure.kind.value}: every rung left needs more host RAM than the host budget"
        )
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


def _search(
    failure: FailureLike,
    knobs: Knobs,
    failed: set[Knobs],
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
    floor = _failed_scale(shape, knobs, budget, settings.targets)
    speed = throughput.calibrate(shape, settings.speeds, settings.targets) if settings.speeds else None
    result = preflight.preflight(
        shape, knobs, budget, scale=max(scale or floor, floor), speed=speed,
        exclude=frozenset(failed), unusable=unusable, host=settings.host, targets=settings.targets,
    )  # fmt: skip
    if not result.fits or result.quality_changed or result.knobs == knobs:
        return None
    names = rungs_between(knobs, result.knobs)
    survives = Survives.OPTIMIZER_RESET if "optimizer" in result.changes else Survives.ALL
    why = "; ".join(RUNG_BY_NAME[name].reason for name in names)
    why += f" (memory model: {result.reasons[-1]})"
    return Restart(result.knobs, "+".join(names), knob_changes(knobs, result.knobs), why, survives)


def _charge_offload(
    knobs: Knobs, failed: set[Knobs], settings: Settings, scale: float | None, unusable: frozenset[str]
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
    killed = _train_host(shape, knobs, settings)
    for base, banned in ((off, frozenset({"activation_offload"})), (knobs, frozenset())):
        result = preflight.preflight(
            shape, base, budget, scale=scale, speed=speed, exclude=frozenset(failed),
            unusable=unusable | banned, host=settings.host, targets=settings.targets,
        )  # fmt: skip
        lighter = not result.knobs.activation_offload or _train_host(shape, result.knobs, settings) < killed
        if result.fits and not result.quality_changed and result.fallback is None and lighter:
            names = ["activation_offload_off" if not result.knobs.activation_offload else ""]
            names += [n for n in rungs_between(off, result.knobs) if n != "activation_offload"]
            rung = "+".join(n for n in names if n)
            survives = Survives.OPTIMIZER_RESET if "optimizer" in result.changes else Survives.ALL
            chose = result.reasons[-1] if result.reasons else "fits both budgets"
            return Restart(result.knobs, rung, knob_changes(knobs, result.knobs), f"{why}; {chose}", survives)
    return None


def _adds_host(killed: Knobs, knobs: Knobs, settings: Settings) -> bool:
    """Whether ``knobs`` need more host RAM in training than ``killed``, by the host model (False
    where it cannot count: no shape for either model). Equal is no more: the model counts the
    child's resident memory as one constant, so checkpointing, the rank and a smaller model come
    out equal, and a kill may still have been the step's own peak that they cut."""
    own, theirs = for_model(settings, knobs.model), for_model(settings, killed.model)
    if own.shape is None or theirs.shape is None:
        return False
    return _train_host(own.shape, knobs, own) > _train_host(theirs.shape, killed, theirs)


def _train_host(shape: memory_model.ModelShape, knobs: Knobs, settings: Settings) -> int:
    """The training phase's host need of ``knobs`` (the checkpoint's size does not enter it)."""
    checkpoint = settings.host.checkpoint_bytes if settings.host is not None else 0
    return host_train_need(shape, knobs, checkpoint, settings.targets).train_peak


def for_model(settings: Settings, model: str) -> Settings:
    """The settings for ``model``: a fallback model's own shape, without the job's model's
    measurements (they calibrate another shape); the job's model: unchanged."""
    shapes = dict(settings.fallback_shapes)
    if model not in shapes:
        return settings
    return dataclasses.replace(settings, shape=shapes[model], prior=(), speeds=())


def _failed_scale(
    shape: memory_model.ModelShape, knobs: Knobs, budget: int, targets: tuple[str, ...] | str
) -> float:
    """The smallest scale of the variable part at which ``knobs`` no longer fits ``budget``."""
    fixed, variable = memory_model.split(memory_model.predict(shape, knobs, targets))
    return max(1.0, (budget - fixed) / variable) if variable > 0 else 1.0


def _scale(history: Sequence[PastAttempt], settings: Settings) -> float | None:
    if settings.shape is None:
        return None
    observations = [
        memory_model.Observation(past.knobs, past.peak_bytes)
        for past in history
        # A peak counts once the attempt finished a whole optimizer step with those knobs (and
        # calibrates only the model it was measured on: the shape is per model).
        if past.steps_progressed > 0 and past.peak_bytes and past.knobs.model == history[-1].knobs.model
    ]
    # This run's own peaks first: with any of them, the host's older ones are not needed.
    return memory_model.calibrate(settings.shape, observations or list(settings.prior), settings.targets)


def _predicted_too_big(knobs: Knobs, settings: Settings, scale: float | None) -> bool:
    own = for_model(settings, knobs.model)
    if own.shape is not settings.shape:  # the walk reached a fallback: its own shape, uncalibrated
        settings, scale = own, None
    if settings.shape is None or settings.budget_bytes is None:
        return False
    card = memory_model.cannot_fit(settings.shape, knobs, settings.budget_bytes, scale, settings.targets)
    return card or _over_host(knobs, settings)


def _over_host(knobs: Knobs, settings: Settings) -> bool:
    """Whether training ``knobs`` needs more host RAM than the host budget allows, as the pre-flight
    counts it (its margin); training's need, not the load's: this run's model has loaded already
    (a fallback's checkpoint is the smaller one). False without a shape or host budget."""
    own = for_model(settings, knobs.model)
    if own.shape is None or own.host is None:
        return False
    return _train_host(own.shape, knobs, own) > preflight.fit_limit(own.host.budget_bytes)


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
