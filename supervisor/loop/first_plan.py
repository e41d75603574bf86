"""Attempt 1's config: the pre-flight's choice (``policies.choice.first``: a quality change only
when nothing else fits; ``nothing_fits`` stops the run before any child), or the job as written
(``--as-written``, or without a shape or a budget to predict with)."""

from __future__ import annotations

from structlog.typing import FilteringBoundLogger

from qlora_supervise.policies import choice, memory_model
from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.memory_model import scaled_peak
from qlora_supervise.policies.search import throughput
from qlora_supervise.policies.search.search_state import PreflightResult, fit_limit
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.journal import Phase, PlanNote
from qlora_supervise.trainer_child.contract.spec import Knobs

#: What ``run`` does for a model the memory model does not cover: it does not guess a number.
UNMODELLED_RUN = (
    "the job starts as written and the reactive ladder alone guards the run "
    "(each OOM is classified, a rung applied, the child resumed from its last checkpoint)"
)


def first_plan(
    knobs: Knobs, settings: policy.Settings, targets: tuple[str, ...] | str, as_written: bool, device: str
) -> Plan:
    """The plan of attempt 1 and its note for the journal."""
    shape, budget = settings.shape, settings.budget_bytes
    if shape is None or budget is None:
        if shape is None and settings.unmodelled:
            missing = f"{settings.unmodelled}: {UNMODELLED_RUN}"
        elif shape is None:
            missing = f"the memory model does not cover this architecture (plan says why): {UNMODELLED_RUN}"
        elif device == "cpu":
            missing = "on the CPU the model (GPU allocations) does not apply; the ladder decides"
        else:
            missing = "no budget (no gpu_memory_limit and no NVML reading)"
        note = PlanNote(None, budget, (f"no memory prediction: {missing}",), as_written=as_written)
        return Plan(Phase.TRAIN, knobs, note=note)
    scale = memory_model.calibrate(shape, list(settings.prior), targets) if settings.prior else None
    speed = throughput.calibrate(shape, settings.speeds, targets) if settings.speeds else None
    result = choice.first(
        shape,
        knobs,
        budget,
        scale=scale,
        targets=targets,
        speed=speed,
        fallbacks=settings.fallback_shapes,
        unusable=settings.cannot_take,  # a foreign tool's config has no key for these
        host=settings.host,
    )
    if as_written:
        reasons = ("run --as-written: the job's config, whatever the plan says", *result.reasons)
        peak = memory_model.predict(shape, knobs, targets).peak_bytes
        return Plan(Phase.TRAIN, knobs, note=PlanNote(peak, budget, reasons, as_written=True))
    reasons = result.reasons
    if scale is not None:
        reasons = (
            *reasons,
            f"calibrated by {len(settings.prior)} peak(s) seen on this host (scale {scale:.2f})",
        )
    if speed is not None:
        reasons = (*reasons, f"ranked with {len(speed.measured)} config(s) this host measured the speed of")
    peak = scaled_peak(result.predicted, scale if result.fallback is None else None)
    note = PlanNote(peak, budget, reasons, dict(result.changes), result.quality_changed)
    trial = result.speed_trial if settings.speed_trial else ()
    return Plan(
        Phase.TRAIN,
        result.knobs,
        note=note,
        speed_trial=trial,
        speed_trial_limit=fit_limit(budget) if trial else None,
        nothing_fits=nothing_fits_text(result),
    )


def announce_plan(log: FilteringBoundLogger, note: PlanNote | None) -> None:
    """``preflight``: attempt 1's config and why; a warning when a quality knob changed."""
    if note is None:
        return
    emit = log.warning if note.quality_changed else log.info
    emit(
        Event.PREFLIGHT,
        predicted_peak_bytes=note.predicted_peak,
        budget_bytes=note.budget,
        changes={k: list(v) for k, v in note.changes.items()},
        quality_changed=note.quality_changed,
        as_written=note.as_written,
        why=" | ".join(note.why),
    )


def nothing_fits_text(result: PreflightResult) -> str | None:
    """What to say when nothing fits: the smallest peak found, the budget, what would help."""
    nothing = result.nothing_fits
    if nothing is None:
        return None
    if nothing.host:
        return (
            "HOST MEMORY: the smallest config that fits the card needs "
            f"{format_bytes(nothing.smallest_peak)} of host RAM against a host budget of "
            f"{format_bytes(nothing.budget_bytes)} (with the {nothing.margin:.0%} margin); "
            f"what would fit: {nothing.help}"
        )
    return (
        f"the smallest config of every rung peaks at {format_bytes(nothing.smallest_peak)} "
        f"against a budget of {format_bytes(nothing.budget_bytes)} (with the {nothing.margin:.0%} margin); "
        f"what would help: {nothing.help}"
    )
