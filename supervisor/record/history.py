"""The journal as others read it: the policy's view of past attempts and the story of a run."""

from __future__ import annotations

from collections.abc import Sequence

from qlora_supervise.policies import decide as policy
from qlora_supervise.supervisor.record.records import AttemptRecord
from qlora_supervise.trainer_child.contract.codes import FailureKind


def policy_history(records: Sequence[AttemptRecord]) -> list[policy.PastAttempt]:
    """Every journalled attempt as the policy sees it (kind None: it did not fail).

    A checkpoint that would not load is no failure of the config (the run resumed from an older
    one, unchanged): it counts toward no limit of the policy.
    """
    return [
        policy.PastAttempt(
            r.knobs,
            r.failure.kind if r.failure and r.failure.kind is not FailureKind.CHECKPOINT_DAMAGED else None,
            r.steps_progressed,
            r.peak.bytes if r.peak else None,
            r.failure.stage if r.failure else None,
            r.steps_completed,
            r.decision.rung if r.decision else None,
            r.unapplied,
        )
        for r in records
    ]


def story(records: Sequence[AttemptRecord]) -> list[str]:
    """One line per attempt, for the final log event."""
    lines = []
    for r in records:
        steps = f"steps {r.resumed_from}->{r.steps_completed}"
        if r.steps_progressed == 0 and r.resumed_from > 0:  # steps_completed 0: it trained none
            steps = f"resumed at {r.resumed_from}, no step trained"
        line = f"attempt {r.attempt} ({r.phase.value}): {r.outcome.value}, {steps}"
        if r.failure:
            line += f", {r.failure.kind.value} in {r.failure.stage.value}"
        if r.decision and r.restarts:
            changes = {name: list(pair) for name, pair in r.decision.changes.items()}
            line += f" -> {r.decision.rung} {changes}, lost {r.lost_steps} steps"
        lines.append(line)
    return lines
