"""Attempt 1's config: the pre-flight's choice, or the job as written.

Before anything runs, the memory model predicts the job against the budget (the cap, or the
card less a reserve). A job predicted to fit with the margin starts as written; otherwise only
throughput knobs change (``policies.preflight``), and a quality change (seq_len, rank) happens
only when nothing else is predicted to fit, logged as a warning with the plan. Without a shape
or a budget there is nothing to predict with: the job runs as written.
"""

from __future__ import annotations

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies import memory_model, preflight
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.record.records import Phase, PlanNote
from qlora_supervise.trainer_child.contract.spec import Knobs


def first_plan(
    knobs: Knobs, settings: policy.Settings, targets: tuple[str, ...] | str, as_written: bool, device: str
) -> Plan:
    """The plan of attempt 1 and its note for the journal."""
    shape, budget = settings.shape, settings.budget_bytes
    if shape is None or budget is None:
        if shape is None:
            missing = "the model's shape is unknown (config.json outside the memory model)"
        elif device == "cpu":
            missing = "on the CPU the model (GPU allocations) does not apply; the ladder decides"
        else:
            missing = "no budget (no gpu_memory_limit and no NVML reading)"
        note = PlanNote(None, budget, (f"no memory prediction: {missing}",), as_written=as_written)
        return Plan(Phase.TRAIN, knobs, note=note)
    # Peaks this host saw for the shape before calibrate the first prediction too.
    scale = memory_model.calibrate(shape, list(settings.prior), targets) if settings.prior else None
    result = preflight.preflight(shape, knobs, budget, scale=scale, targets=targets)
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
    peak = preflight.scaled_peak(result.predicted, scale)
    note = PlanNote(peak, budget, reasons, dict(result.changes), result.quality_changed)
    return Plan(Phase.TRAIN, result.knobs, note=note)
