"""After an attempt: judged, decided, journalled, announced; the arbiter is told where to go next.

Both ways an attempt ends come here (the runner watched it, or the reclaim found it after the
supervisor itself died). :meth:`Conclusions.conclude` judges the outcome; a failure goes to the
policy (:mod:`.decision`) and :meth:`~Conclusions.answer` turns the policy's answer into a
:class:`Turn`: a ``Wait`` leads to WAITING without a journal line yet; a ``Restart`` or
``GiveUp`` is journalled (fsynced) before the arbiter acts on it, and announced from its line.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from structlog.typing import FilteringBoundLogger

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.rungs import Survives
from qlora_supervise.supervisor.diagnosis.cap_advice import with_named_cap
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.loop import decision as deciding
from qlora_supervise.supervisor.loop.announce import announce_decision, announce_failure, announce_success
from qlora_supervise.supervisor.loop.climb_back import PlannedRestart
from qlora_supervise.supervisor.loop.outcome import AttemptOutcome, failure_record, judge, record_of
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.loop.resume import log_quarantined, quarantine_reported, resume_point
from qlora_supervise.supervisor.loop.settings import (
    predicted_host,
    remember_attempt,
    step_fit,
    with_sample_lengths,
    with_script_model,
)
from qlora_supervise.supervisor.loop.waiting import DiskWaiter
from qlora_supervise.supervisor.record.attempt_speed import speed_of
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.journal import RunState, append_attempt
from qlora_supervise.supervisor.record.records import Action, AttemptRecord, DecisionRecord, Outcome, Phase
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.events import ChildEvent, script_settings
from qlora_supervise.trainer_child.contract.script_knobs import as_built
from qlora_supervise.trainer_child.contract.spec import Knobs


@dataclasses.dataclass(frozen=True)
class Turn:
    """Where the arbiter goes next: a state, with what that state acts on (RUNNING: the plan to
    run; WAITING: the failed attempt whose answer waits)."""

    state: RunState
    pending: deciding.Pending | None = None
    plan: Plan | None = None


@dataclasses.dataclass
class Conclusions:
    """The journal's writer. ``settings`` are the policy's, updated by what each attempt showed
    (sample lengths, peaks, speeds); ``lifted_after``: attempts up to this one had a verdict
    that was lifted, so the policy's budgets count only the attempts after it."""

    job: Job
    rd: RunDir
    log: FilteringBoundLogger
    disk: DiskWaiter
    settings: policy.Settings
    lifted_after: int = 0

    def _as_trained(self, o: AttemptOutcome) -> AttemptOutcome:
        """``o`` with the knobs the attempt trained with: the policy's choice among the timings of its
        speed trial (from its events, read once), which may have switched the plan's micro-batch and
        checkpointing (its reason joins the plan's), and what a script reports it built. The journal,
        the policy's history and the never-repeat-a-failed-config rule all key on what ran."""
        trial = speed_of(o.progress.events, o.plan.knobs).choice
        # A script with its settings in its code: what it built (attempt 1 learns what it asks for).
        trained = as_built(trial.knobs if trial else o.plan.knobs, script_settings(o.progress.events))
        # The host model's training peak for what ran: status and explain set the measured one beside it.
        o = dataclasses.replace(o, host_predicted=predicted_host(self.settings, trained))
        note = o.plan.note
        if trial is not None:
            note = note and dataclasses.replace(note, why=(*note.why, trial.why))
        elif trained == o.plan.knobs:
            return o
        return dataclasses.replace(o, plan=dataclasses.replace(o.plan, knobs=trained, note=note))

    def conclude(self, o: AttemptOutcome, records: list[AttemptRecord], reclaimed: bool = False) -> Turn:
        """The one path from an ended attempt (watched or reclaimed) to its journal line."""
        o = self._as_trained(o)
        log = self.log.bind(attempt=o.number)
        fit = step_fit(self.settings, self.job.resources.device, o.plan)
        verdict = judge(o, self._phase_done(o.plan.phase), fit)
        if isinstance(verdict, Failure):
            verdict = self.disk.explain(verdict)
            announce_failure(log, verdict, o.report, reclaimed)
            return self._decide(o, verdict, records, log)
        if verdict is Outcome.STEPPED_UP and o.planned is not None:
            return self._planned(o, o.planned, records)
        next_from = None if verdict is Outcome.SUCCEEDED else self.resume_step(o.plan.knobs)
        record = self.journal(record_of(o, verdict, next_from), records, o.progress.events)
        if verdict is Outcome.STOPPED:
            return Turn(RunState.STOPPED)  # RUNNING -> STOPPED
        if verdict is Outcome.SUCCEEDED:
            announce_success(log, record, records, self.job.train.merge, self.rd, reclaimed)
        else:
            log.info(
                Event.ATTEMPT_INTERRUPTED,
                steps=record.steps_completed,
                resume_from=record.next_resume_from,
                why="the supervisor stopped while this attempt ran; its config is not counted as failed",
            )
        return Turn(RunState.STARTING)  # RUNNING -> STARTING: the plan says what is left (a merge, or done)

    def _planned(self, o: AttemptOutcome, planned: PlannedRestart, records: list[AttemptRecord]) -> Turn:
        """A planned restart (a step-up or a re-time) journalled as the restart decision it is."""
        # Back to the 32-bit optimizer: its state starts afresh (the resume reads that off the checkpoint).
        survives = Survives.OPTIMIZER_RESET if "optimizer" in planned.changes else Survives.ALL
        entry = DecisionRecord(
            Action.RESTART, planned.why, planned.rung, planned.changes, survives, planned.knobs,
            undoes=planned.undoes,
        )  # fmt: skip
        self.journal(
            record_of(o, Outcome.STEPPED_UP, self.resume_step(planned.knobs), None, entry),
            records,
            o.progress.events,
        )
        return Turn(RunState.STARTING)  # RUNNING -> STARTING: the plan follows the decision

    def answer(self, pending: deciding.Pending, records: list[AttemptRecord]) -> Turn:
        """Act on the policy's answer: a Wait is carried out first; a Restart or GiveUp is journalled."""
        decision = pending.decision
        if isinstance(decision, policy.Wait):
            return Turn(RunState.WAITING, pending)  # RUNNING -> WAITING
        next_from = None
        if isinstance(decision, policy.GiveUp):  # a memory give-up names the cap (issue 21 item 7)
            seen = [*records, pending.record]
            knobs = pending.outcome.plan.knobs
            decision = with_named_cap(decision, pending.failure.kind, knobs, self.job, self.settings, seen)
        if isinstance(decision, policy.Restart):
            reinit = decision.survives is Survives.ADAPTER_REINIT
            next_from = 0 if reinit else self.resume_step(decision.knobs)
        record = self.journal(
            deciding.settled(pending, decision, next_from), records, pending.outcome.progress.events
        )
        announce_decision(self.log.bind(attempt=record.attempt), record, records, self.rd)
        return _after(record)

    def after_wait(
        self, pending: deciding.Pending, waited: policy.WaitResult, records: list[AttemptRecord]
    ) -> Turn:
        """The policy asked again with what its Wait saw; a stop that ended the wait is no verdict."""
        if waited.stopped:
            # WAITING -> STOPPED: no verdict on the config; the run stays resumable.
            next_from = self.resume_step(pending.outcome.plan.knobs)
            self.journal(
                deciding.stopped_while_waiting(pending, next_from), records, pending.outcome.progress.events
            )
            return Turn(RunState.STOPPED)
        return self.answer(deciding.ask_again(pending, waited, self.settings), records)  # WAITING -> ...

    def journal(
        self, record: AttemptRecord, records: list[AttemptRecord], events: Sequence[ChildEvent]
    ) -> AttemptRecord:
        """Append ``record`` to ``attempts.jsonl`` (fsynced) and to ``records``; ``events``: the
        attempt's, read once by its heartbeat reader."""
        append_attempt(self.rd.attempts, record)
        records.append(record)
        speed = speed_of(events, record.knobs)
        self.settings = remember_attempt(self.settings, self.job, record, speed)  # peak and speed kept
        return record

    def resume_step(self, knobs: Knobs) -> int:
        """The step an attempt with ``knobs`` would resume from: the same rule the spawn uses."""
        return resume_point(self.rd.checkpoints, knobs).step

    def _decide(
        self, o: AttemptOutcome, failure: Failure, records: list[AttemptRecord], log: FilteringBoundLogger
    ) -> Turn:
        self.settings = with_sample_lengths(self.settings, o.progress.events)
        self.settings = with_script_model(self.settings, o.progress.events)
        if failure.kind is FailureKind.CHECKPOINT_DAMAGED and (
            quarantined := self._quarantine(o, failure, records, log)
        ):
            return _after(quarantined)
        if failure.kind is FailureKind.DISK_FULL:
            failure = self.disk.with_room_needed(failure)
        # A lifted verdict starts the budgets afresh: the attempts before it were judged already.
        earlier = [r for r in records if r.attempt > self.lifted_after]
        return self.answer(deciding.ask(o, failure, earlier, self.settings), records)

    def _quarantine(
        self, o: AttemptOutcome, failure: Failure, records: list[AttemptRecord], log: FilteringBoundLogger
    ) -> AttemptRecord | None:
        """The checkpoint the child could not load is moved aside and the same knobs resume from
        the next older one (no verdict on the config); None when it cannot be moved (the policy
        then decides as for any failure)."""
        moved = quarantine_reported(o.report, self.rd.checkpoints)
        if moved is None:
            return None
        log_quarantined(log, [moved])
        entry = DecisionRecord.retry_from_older(o.plan.knobs, moved.path.name)
        line = record_of(
            o, Outcome.FAILED, self.resume_step(o.plan.knobs), failure_record(failure, o.report), entry
        )
        record = self.journal(line, records, o.progress.events)
        announce_decision(log, record, records, self.rd)
        return record

    def _phase_done(self, phase: Phase) -> bool:
        if phase is Phase.TRAIN and self.job.trainer.saved_alone(self.rd.root):
            return True  # a tool without the shim saves into its own output dir only
        return (self.rd.merged if phase is Phase.MERGE else self.rd.adapter).exists()


def _after(record: AttemptRecord) -> Turn:
    if deciding.unchanged_retry(record):
        return Turn(RunState.BACKOFF)  # RUNNING | WAITING -> BACKOFF: the same config again
    return Turn(RunState.STARTING)  # RUNNING | WAITING -> STARTING: a new config, or the verdict
