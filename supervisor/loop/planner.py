"""The planner: what the next attempt runs, from the journal alone. Pure: no writes. Attempt 1's
config is the pre-flight's choice (``policies.choice.first``: a quality change only when nothing
else fits; ``nothing_fits`` stops the run before any child), or the job as written (``--as-written``,
or without a shape or a budget to predict with).

no attempt yet                 -> train with the job's knobs
last attempt stopped or was
  interrupted (no verdict)     -> the same phase and knobs again
last attempt succeeded         -> merge (when asked and not done yet) or the run's verdict
last decision was a restart    -> its knobs; from step 0 when the adapter shape changed (a planned
                                  restart, a step-up or a re-time, is one; a re-time times the
                                  pre-flight's candidates again)
last decision was a give-up    -> the run's verdict (retryable or not; a GPU fault has its own),
                                  unless a changed job or ``run --retry`` lifted it: then the
                                  ladder's next rung for a memory give-up, else that attempt's
                                  phase and knobs again"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from structlog.typing import FilteringBoundLogger

from qlora_supervise.policies import choice, memory_model
from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.rungs import Survives
from qlora_supervise.policies.search import throughput
from qlora_supervise.policies.search.search_state import PreflightResult, fit_limit
from qlora_supervise.supervisor.exit_codes import SupervisorExitCode
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.history import policy_history
from qlora_supervise.supervisor.record.journal import AttemptRecord, Outcome, Phase, PlanNote, RunState
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.spec import Knobs, TrialCandidate


@dataclasses.dataclass(frozen=True)
class Plan:
    """What the next attempt runs."""

    phase: Phase
    knobs: Knobs
    fresh_start: bool = False  # the adapter's shape changed: old checkpoints cannot be loaded
    note: PlanNote | None = None  # why these knobs (the pre-flight's reasons, attempt 1)
    speed_trial: tuple[TrialCandidate, ...] = ()  # timed before step 1, these knobs first (empty: none)
    speed_trial_limit: int | None = None  # the most a candidate may measure (budget less margin)
    nothing_fits: str | None = None  # attempt 1 only: the run stops before any child, with this message
    retime: bool = False  # a re-time (policies/choice.py): the trial runs on the resume too


@dataclasses.dataclass(frozen=True)
class Verdict:
    """The run is over: the state to write and the exit code."""

    run_state: RunState
    exit_code: SupervisorExitCode
    note: str
    knobs: Knobs


@dataclasses.dataclass(frozen=True)
class PlanFacts:
    """What the planner needs beyond the journal."""

    first: Plan  # attempt 1: the pre-flight's choice
    merge: bool  # the job asks for a merged model after training
    merged_exists: bool
    lifted_after: int = 0  # the newest lift's attempt: a verdict up to it no longer stands
    settings: policy.Settings | None = None  # a lifted memory give-up takes the ladder's next rung


def next_plan(records: Sequence[AttemptRecord], facts: PlanFacts) -> Plan | Verdict:
    """The next attempt, or the verdict when there is none."""
    if not records:
        return facts.first
    last = records[-1]
    if last.outcome in (Outcome.STOPPED, Outcome.INTERRUPTED):
        return Plan(last.phase, last.knobs)
    if last.outcome is Outcome.SUCCEEDED:
        if last.attempt <= facts.lifted_after:  # a finished run extended: train on from its checkpoint
            train = [r for r in records if r.phase is Phase.TRAIN]
            return Plan(Phase.TRAIN, train[-1].knobs if train else last.knobs)
        if last.phase is Phase.TRAIN and facts.merge and not facts.merged_exists:
            return Plan(Phase.MERGE, last.knobs)
        return Verdict(RunState.SUCCEEDED, SupervisorExitCode.FINISHED, "finished", last.knobs)
    decision = last.decision
    if decision is not None and decision.rung == choice.RETIME_RUNG and decision.knobs is not None:
        first = facts.first  # the pre-flight's candidates, timed again on the card as it is now
        trial = choice.first_for(decision.knobs, first.speed_trial)
        limit = first.speed_trial_limit
        return Plan(last.phase, decision.knobs, speed_trial=trial, speed_trial_limit=limit, retime=True)
    if last.restarts and decision is not None and decision.knobs is not None:
        return Plan(last.phase, decision.knobs, fresh_start=decision.survives is Survives.ADAPTER_REINIT)
    if last.attempt <= facts.lifted_after:
        rung = next_rung_after_lift(records, facts.settings) if facts.settings is not None else None
        if rung is not None:  # a memory give-up: the ladder's next rung, not the config that failed
            return Plan(last.phase, rung.knobs, fresh_start=rung.survives is Survives.ADAPTER_REINIT)
        return Plan(last.phase, last.knobs)  # the verdict was lifted: try its config once more
    if decision is not None and not decision.retryable:
        gpu_fault = last.failure is not None and last.failure.kind is FailureKind.GPU_FAULT
        code = SupervisorExitCode.GPU_FAULT if gpu_fault else SupervisorExitCode.NOT_RETRYABLE
        return Verdict(RunState.FAILED, code, decision.why, last.knobs)
    why = decision.why if decision is not None else "the last attempt failed without a decision"
    return Verdict(RunState.GAVE_UP, SupervisorExitCode.GAVE_UP, why, last.knobs)


def next_rung_after_lift(
    records: Sequence[AttemptRecord], settings: policy.Settings
) -> policy.Restart | None:
    """``run --retry`` after a memory give-up: the policy's restart for the last attempt's failure,
    asked again with a fresh attempt budget (replaying the failed config would fail the same way,
    issue 21 item 15); None when it did not fail of memory or the ladder has nothing left."""
    last = records[-1] if records else None
    if last is None or last.failure is None or not last.failure.kind.is_oom:
        return None
    history = policy_history([r for r in records if r.phase is last.phase])
    failed = sum(1 for past in history if past.kind is not None)
    fresh = dataclasses.replace(settings, max_attempts=settings.max_attempts + failed)
    decision = policy.decide(last.failure, last.knobs, history, fresh, phase=last.phase.value)
    if not isinstance(decision, policy.Restart) or decision.knobs == last.knobs:
        return None
    return decision


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
        calibrated = f"calibrated by {len(settings.prior)} peak(s) seen on this host (scale {scale:.2f})"
        reasons = (*reasons, calibrated)
    if speed is not None:
        reasons = (*reasons, f"ranked with {len(speed.measured)} config(s) this host measured the speed of")
    peak = memory_model.scaled_peak(result.predicted, scale if result.fallback is None else None)
    note = PlanNote(peak, budget, reasons, dict(result.changes), result.quality_changed)
    trial = result.speed_trial if settings.speed_trial else ()
    limit, nothing = fit_limit(budget) if trial else None, nothing_fits_text(result)
    return Plan(
        Phase.TRAIN, result.knobs, note=note, speed_trial=trial, speed_trial_limit=limit, nothing_fits=nothing
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
    if (nothing := result.nothing_fits) is None:
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
