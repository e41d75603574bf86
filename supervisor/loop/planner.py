"""The planner: what the next attempt runs, from the journal alone. Pure: no writes.

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
                                  phase and knobs again
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.choice import RETIME_RUNG, first_for
from qlora_supervise.policies.rungs import Survives
from qlora_supervise.supervisor.exit_codes import SupervisorExitCode
from qlora_supervise.supervisor.record.history import policy_history
from qlora_supervise.supervisor.record.journal import (
    Action,
    AttemptRecord,
    Outcome,
    Phase,
    PlanNote,
    RunState,
)
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.spec import Knobs, TrialCandidate


@dataclass(frozen=True)
class Plan:
    """What the next attempt runs."""

    phase: Phase
    knobs: Knobs
    fresh_start: bool = False  # the adapter's shape changed: old checkpoints cannot be loaded
    note: PlanNote | None = None  # why these knobs (the pre-flight's reasons, attempt 1)
    # The candidates the child's speed trial times before step 1, these knobs first (empty: no trial).
    speed_trial: tuple[TrialCandidate, ...] = ()
    # The most a trial candidate may measure (the pre-flight's budget less its margin); None: no check.
    speed_trial_limit: int | None = None
    # Attempt 1 only: nothing is predicted to fit; the run stops before any child, with this message.
    nothing_fits: str | None = None
    retime: bool = False  # a re-time (policies/choice.py): the trial runs on the resume too


@dataclass(frozen=True)
class Verdict:
    """The run is over: the state to write and the exit code."""

    run_state: RunState
    exit_code: SupervisorExitCode
    note: str
    knobs: Knobs


@dataclass(frozen=True)
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
    if decision is not None and decision.rung == RETIME_RUNG and decision.knobs is not None:
        first = facts.first  # the pre-flight's candidates, timed again on the card as it is now
        trial = first_for(decision.knobs, first.speed_trial)
        limit = first.speed_trial_limit
        return Plan(last.phase, decision.knobs, speed_trial=trial, speed_trial_limit=limit, retime=True)
    if decision is not None and decision.action is Action.RESTART and decision.knobs is not None:
        return Plan(last.phase, decision.knobs, fresh_start=decision.survives is Survives.ADAPTER_REINIT)
    if last.attempt <= facts.lifted_after:
        rung = next_rung_after_lift(records, facts.settings) if facts.settings is not None else None
        if rung is not None:  # a memory give-up: the ladder's next rung, not the config that failed
            return Plan(last.phase, rung.knobs, fresh_start=rung.survives is Survives.ADAPTER_REINIT)
        return Plan(last.phase, last.knobs)  # the verdict was lifted: try its config once more
    if decision is not None and not decision.retryable:
        failure = last.failure
        gpu_fault = failure is not None and failure.kind is FailureKind.GPU_FAULT
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
