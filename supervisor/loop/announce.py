"""The log lines that tell a person how an attempt ended: a success, a retry, or giving up.

Each holds everything needed to understand that moment from the line alone (``jq`` on
``events.jsonl``): the failure, the rung, the changes, the progress kept, the story so far.
"""

from __future__ import annotations

from collections.abc import Sequence

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.history import story
from qlora_supervise.supervisor.record.records import AttemptRecord, Phase, PlanNote
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.trainers.trainer import saved_by_the_tool_only
from qlora_supervise.trainer_child.contract.report import ErrorReport


def announce_plan(log: FilteringBoundLogger, note: PlanNote | None) -> None:
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
    log: FilteringBoundLogger,
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
        # The event names what is there, never an adapter folder that was not written.
        tool_output = saved_by_the_tool_only(rd.root, rd.adapter)
        log.info(
            Event.RUN_SUCCEEDED,
            attempts=record.attempt,
            steps=max(r.steps_completed for r in records if r.phase is Phase.TRAIN),
            adapter=str(rd.adapter) if rd.adapter.exists() else None,
            trainer_output=str(tool_output) if tool_output is not None else None,
            merged=str(rd.merged) if record.phase is Phase.MERGE else None,
            story=story(records),
        )


def announce_failure(
    log: FilteringBoundLogger, failure: Failure, report: ErrorReport | None, reclaimed: bool
) -> None:
    """``failure_classified``: what the classifier found, and from which evidence."""
    log.info(
        Event.FAILURE_CLASSIFIED,
        kind=failure.kind.value,
        stage=failure.stage.value,
        numbers=failure.numbers_json(),
        evidence=failure.evidence,
        message=failure.message[:500],
        reclaimed=reclaimed,
        memory_snapshot=report.memory_snapshot if report else None,
        rank=failure.rank,
        local_rank=failure.local_rank,
        gpu=failure.gpu,
    )


def announce_decision(
    log: FilteringBoundLogger, record: AttemptRecord, records: Sequence[AttemptRecord], rd: RunDir
) -> None:
    """``retry`` (a warning: the run goes on) or ``gave_up`` (an error: it does not), read from the
    attempt's journal line alone: what the log says is what the journal keeps."""
    decision, failure = record.decision, record.failure
    assert decision is not None and failure is not None, "only a decided failure is announced"
    if record.restarts and decision.knobs is not None:
        log.warning(
            Event.RETRY,
            failed=failure.kind.value,
            stage=failure.stage.value,
            numbers=failure.numbers_json(),
            rung=decision.rung,
            changes={k: list(v) for k, v in decision.changes.items()},
            why=decision.why,
            progress_survives=decision.survives.value,
            steps_completed=record.steps_completed,
            resume_from=record.next_resume_from,
            lost_steps=record.lost_steps,
            emergency_checkpoint=bool(failure.emergency_checkpoint),
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
