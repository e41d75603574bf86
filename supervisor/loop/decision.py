"""The policy's answer to a failed attempt, asked with what the attempt's journal line says.

A failed attempt's line is built once, before the policy is asked (:func:`ask`): the policy's
view of that attempt (its knobs, kind, steps and peak) is derived from the line, as every
earlier attempt's is (:func:`~..record.history.policy_history`), so what the policy weighed and
what the journal keeps cannot differ. A ``Wait`` is carried out by the arbiter and the policy
asked again with what it saw (:func:`ask_again`); a ``Restart`` or ``GiveUp`` completes the line
(:func:`settled`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from qlora_supervise.policies import decide as policy
from qlora_supervise.supervisor.diagnosis.repeat import repeat_note
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.supervisor.loop.outcome import AttemptOutcome, failure_record, record_of
from qlora_supervise.supervisor.record.history import policy_history
from qlora_supervise.supervisor.record.records import AttemptRecord, DecisionRecord, Outcome


@dataclasses.dataclass(frozen=True)
class Pending:
    """A failed attempt between its classification and its journal line.

    ``record``: the line without its decision (outcome FAILED, the failure filled in from the
    report). ``history``: what the policy was asked with, this attempt last.
    """

    outcome: AttemptOutcome
    failure: Failure
    record: AttemptRecord
    history: tuple[policy.PastAttempt, ...]
    decision: policy.Decision
    waited: policy.WaitResult | None = None


def ask(
    o: AttemptOutcome, failure: Failure, earlier: Sequence[AttemptRecord], settings: policy.Settings
) -> Pending:
    """The policy's first answer; ``earlier`` are the journalled attempts its budgets count."""
    record = record_of(o, Outcome.FAILED, None, failure_record(failure, o.report, o.progress))
    # The failure's own kind even when it is a damaged checkpoint that could not be moved aside:
    # later decisions leave that kind out of their budgets, but this one decides about it.
    this = dataclasses.replace(policy_history([record])[0], kind=failure.kind)
    history = (*policy_history(earlier), this)
    decision = policy.decide(failure, o.plan.knobs, history, settings, phase=o.plan.phase.value)
    return Pending(o, failure, record, history, _with_repeat(decision, failure, earlier, o, settings))


def _with_repeat(
    decision: policy.Decision,
    failure: Failure,
    earlier: Sequence[AttemptRecord],
    o: AttemptOutcome,
    settings: policy.Settings,
) -> policy.Decision:
    """The decision, saying so when the OOM repeats at the data position of the attempt before
    (:mod:`..diagnosis.repeat`): which rows, and what a shorter max_seq_len would cut."""
    before = next((r.failure for r in reversed(earlier) if r.failure is not None), None)
    note = repeat_note(failure, before, o.plan.knobs.max_seq_len, settings.sample_lengths)
    if note is None or isinstance(decision, policy.Wait):
        return decision
    return dataclasses.replace(decision, why=f"{decision.why}; {note}")


def ask_again(pending: Pending, waited: policy.WaitResult, settings: policy.Settings) -> Pending:
    """The policy's answer after its ``Wait`` was carried out and ``waited`` is what it saw."""
    o = pending.outcome
    decision = policy.decide(
        pending.failure, o.plan.knobs, pending.history, settings, waited=waited, phase=o.plan.phase.value
    )
    return dataclasses.replace(pending, decision=decision, waited=waited)


def settled(
    pending: Pending, decision: policy.Restart | policy.GiveUp, next_from: int | None
) -> AttemptRecord:
    """The journal line of a decided attempt: its record with the decision and the steps it loses."""
    entry = DecisionRecord.of(decision, pending.waited.waited_s if pending.waited else 0.0)
    return record_of(pending.outcome, Outcome.FAILED, next_from, pending.record.failure, entry)


def stopped_while_waiting(pending: Pending, next_from: int) -> AttemptRecord:
    """The journal line when a stop ended the wait: no verdict on the config, the run resumable."""
    return record_of(pending.outcome, Outcome.STOPPED, next_from, pending.record.failure)


def unchanged_retry(record: AttemptRecord) -> bool:
    """Whether the next attempt repeats this one's config with no wait in between: only such a
    retry backs off (a changed config, or one that waited for memory, starts at once)."""
    decision = record.decision
    return (
        record.restarts and decision is not None and decision.knobs == record.knobs and not decision.waited_s
    )
