"""The ladder walk: the stage's rungs in order, after a memory failure the search could not answer.
A rung with nothing to change, charged or untakeable is skipped; a result that failed the same way,
or that a calibrated memory model (or the host budget) says cannot fit, is kept and the next rung
applied on top; after a host OOM kill no rung that needs more host RAM than the killed config."""

from __future__ import annotations

from collections.abc import Sequence

from qlora_supervise.policies import memory_model, rungs
from qlora_supervise.policies.memory.host import host_train_need
from qlora_supervise.policies.memory.shape import Targets
from qlora_supervise.policies.rungs import Rung, Survives, knob_changes, ladder_for, rung_by_name
from qlora_supervise.policies.search.search_state import fit_limit
from qlora_supervise.policies.verdicts import FailureLike, GiveUp, PastAttempt, Restart, Settings, for_model
from qlora_supervise.trainer_child.contract.attempt_facts import SampleLengths
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.spec import Knobs

_SURVIVAL_ORDER = (Survives.ALL, Survives.OPTIMIZER_RESET, Survives.ADAPTER_REINIT)


def walk(
    failure: FailureLike,
    knobs: Knobs,
    failed_same_way: frozenset[Knobs],
    settings: Settings,
    scale: float | None,
    unusable: frozenset[str],
) -> Restart | GiveUp:
    """The stage's ladder from ``knobs`` (``settings`` already those of its model)."""
    context = rungs.RungContext(settings.fallbacks, getattr(failure, "local_rank", None))
    candidate = knobs
    applied: list[Rung] = []
    skipped: list[str] = []
    for name in ladder_for(failure.kind, failure.stage, settings.overrides):
        if name in unusable:
            continue
        rung = rung_by_name(name, context)
        if (changed := rung.apply(candidate)) is None or changed in failed_same_way:
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
        if (stepped := rung.apply(knobs)) is not None and not _over_host(stepped, settings):
            return _restart(knobs, stepped, [rung], [], settings.sample_lengths)
    kind = failure.kind.value
    if applied:
        return GiveUp(f"ladder for {kind}: every rung left needs more host RAM than the host budget")
    return GiveUp(f"ladder for {kind} exhausted: no rung changes this config any further")


def _adds_host(killed: Knobs, knobs: Knobs, settings: Settings) -> bool:
    """Whether ``knobs`` need more host RAM in training than ``killed``, by the host model (False
    where it cannot count). Equal is no more: checkpointing, the rank and a smaller model come out
    equal (one constant for the resident child), and may still cut the step's own peak."""
    own, theirs = for_model(settings, knobs.model), for_model(settings, killed.model)
    if own.shape is None or theirs.shape is None:
        return False
    return train_host(own.shape, knobs, own) > train_host(theirs.shape, killed, theirs)


def train_host(shape: memory_model.ModelShape, knobs: Knobs, settings: Settings) -> int:
    """The training phase's host need of ``knobs`` (the checkpoint's size does not enter it)."""
    checkpoint = settings.host.checkpoint_bytes if settings.host is not None else 0
    return host_train_need(shape, knobs, checkpoint, settings.targets).train_peak


def failed_scale(shape: memory_model.ModelShape, knobs: Knobs, budget: int, targets: Targets) -> float:
    """The smallest scale of the variable part at which ``knobs`` no longer fits ``budget``."""
    fixed, variable = memory_model.split(memory_model.predict(shape, knobs, targets))
    return max(1.0, (budget - fixed) / variable) if variable > 0 else 1.0


def calibrated_scale(history: Sequence[PastAttempt], settings: Settings) -> float | None:
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
    """Whether training ``knobs`` needs more host RAM than the host budget with the pre-flight's
    margin (training's need: the model has loaded already). False without a shape or host budget."""
    own = for_model(settings, knobs.model)
    if own.shape is None or own.host is None:
        return False
    return train_host(own.shape, knobs, own) > fit_limit(own.host.budget_bytes)


def _restart(
    old: Knobs, new: Knobs, applied: list[Rung], skipped: list[str], lengths: SampleLengths | None
) -> Restart:
    # Each rung's reason, with what it costs where that is known (the samples a shorter seq_len cuts).
    cost = ""
    if lengths is not None and any(rung.name == "shorten_seq_len" for rung in applied):
        cost = f": {rungs.shorten_cost_text(lengths, old, new)}"
    why = "; ".join(rung.reason + (cost if rung.name == "shorten_seq_len" else "") for rung in applied)
    if skipped:
        why += f" (memory model: {', '.join(skipped)} alone would not fit)"
    survives = max((rung.survives for rung in applied), key=_SURVIVAL_ORDER.index)
    return Restart(new, "+".join(rung.name for rung in applied), knob_changes(old, new), why, survives)
