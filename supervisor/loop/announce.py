"""The log lines that tell a person how an attempt ended: a success, a retry, or giving up.

Each holds everything needed to understand that moment from the line alone (``jq`` on
``events.jsonl``): the failure, the rung, the changes, the progress kept, the story so far.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from qlora_supervise.supervisor.diagnosis.failure import Failure
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.history import story
from qlora_supervise.supervisor.record.records import AttemptRecord, Phase, PlanNote
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract.report import ErrorReport


def announce_plan(log: Any, note: PlanNote | None) -> None:
    """``preflight``: attempt 1's config and why; a warning when a quality knob changed."""
    if note is None:
        return
    # A quality change before the first attempt is loud: the user asked for that seq_len/rank.
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


def announce_success(
    log: Any,
    record: AttemptRecord,
    records: Sequence[AttemptRecord],
    merge: bool,
    rd: RunDir,
    reclaimed: bool,
) -> None:
    """``attempt_succeeded``, and ``run_succeeded`` when nothing (no merge) is left to run."""
    log.info(
        Event.ATTEMPT_SUCCEEDED, phase=record.phase.value, steps=record.steps_completed, reclaimed=reclaimed
    )
    if record.phase is Phase.MERGE or not merge:
        log.info(
            Event.RUN_SUCCEEDED,
            attempts=record.attempt,
            steps=max(r.steps_completed for r in records if r.phase is Phase.TRAIN),
            adapter=str(rd.adapter),
            merged=str(rd.merged) if record.phase is Phase.MERGE else None,
            story=story(records),
        )


def announce_decision(
    log: Any,
    record: AttemptRecord,
    failure: Failure,
    report: ErrorReport | None,
    records: Sequence[AttemptRecord],
    rd: RunDir,
) -> None:
    """``retry`` (a warning: the run goes on) or ``gave_up`` (an error: it does not)."""
    decision = record.decision
    assert decision is not None
    if record.restarts and decision.knobs is not None:
        log.warning(
            Event.RETRY,
            failed=failure.kind.value,
            stage=failure.stage.value,
            numbers=dict(failure.numbers),
            rung=decision.rung,
            changes={k: list(v) for k, v in decision.changes.items()},
            why=decision.why,
            progress_survives=decision.survives.value,
            steps_completed=record.steps_completed,
            resume_from=record.next_resume_from,
            lost_steps=record.lost_steps,
            emergency_checkpoint=bool(report and report.emergency_checkpoint),
            effective_batch=decision.knobs.effective_batch,
        )
        return
    log.error(
        Event.GAVE_UP,
        failed=failure.kind.value,
        stage=failure.stage.value,
        why=decision.why,
        retryable=decision.retryable,
        message=failure.message[:500],
        journal=str(rd.attempts),
        story=story(records),
    )
