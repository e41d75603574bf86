"""The journal as others read it: the policy's view of past attempts, journal entries for a
failure and a decision, and the one-line-per-attempt story of a run."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from qlora_supervise.policies import decide as policy
from qlora_supervise.supervisor.diagnosis.failure import Failure
from qlora_supervise.supervisor.record.journal import AttemptRecord, knobs_from_record
from qlora_supervise.trainer_child.protocol import ErrorReport, FailureKind


def policy_history(records: Sequence[AttemptRecord]) -> list[policy.PastAttempt]:
    """Every journalled attempt as the policy sees it (kind None: it did not fail)."""
    out = []
    for r in records:
        kind = FailureKind(r.failure["kind"]) if r.failure else None
        peak = r.peak_memory.get("gpu_process") or r.peak_memory.get("child_peak")
        out.append(policy.PastAttempt(knobs_from_record(r), kind, r.steps_progressed, peak))
    return out


def failure_entry(failure: Failure, report: ErrorReport | None) -> dict[str, Any]:
    return {
        "kind": failure.kind.value,
        "stage": failure.stage.value,
        "numbers": dict(failure.numbers),
        "evidence": failure.evidence,
        "message": failure.message[:2000],
        "emergency_checkpoint": report.emergency_checkpoint if report else None,
        "expandable_segments_active": report.expandable_segments_active if report else None,
    }


def decision_entry(decision: policy.Decision) -> dict[str, Any]:
    if isinstance(decision, policy.Restart):
        return {
            "action": "restart",
            "rung": decision.rung,
            "changes": {k: list(v) for k, v in decision.changes.items()},
            "why": decision.why,
            "survives": decision.survives.value,
            "knobs": dataclasses.asdict(decision.knobs),
        }
    if isinstance(decision, policy.GiveUp):
        return {"action": "give_up", "why": decision.why, "retryable": decision.retryable}
    return {"action": "wait", "why": decision.why, "seconds": decision.seconds}


def story(records: Sequence[AttemptRecord]) -> list[str]:
    """One line per attempt, for the final log event."""
    lines = []
    for r in records:
        line = f"attempt {r.attempt} ({r.phase}): {r.outcome}, steps {r.resumed_from}->{r.steps_completed}"
        if r.failure:
            line += f", {r.failure['kind']} in {r.failure['stage']}"
        if r.decision and r.decision.get("action") == "restart":
            line += f" -> {r.decision['rung']} {r.decision['changes']}, lost {r.lost_steps} steps"
        lines.append(line)
    return lines
