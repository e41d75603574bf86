"""After an attempt: judged, decided, journalled, announced; the arbiter is told where to go next.
The policy is asked with the failed attempt's journal line, so what it weighed and what the journal
keeps cannot differ; a decision is journalled (fsynced) before the arbiter acts on it."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from structlog.typing import FilteringBoundLogger

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.rungs import Survives
from qlora_supervise.supervisor.diagnosis.advice import repeat_note, with_named_cap
from qlora_supervise.supervisor.diagnosis.fragmentation import predicted_fit
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.loop import settings as job_settings
from qlora_supervise.supervisor.loop.climb_back import PlannedRestart
from qlora_supervise.supervisor.loop.outcome import AttemptOutcome, failure_record, judge, record_of
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.loop.resume import log_quarantined, quarantine_reported, resume_point
from qlora_supervise.supervisor.loop.waiting import DiskWaiter
from qlora_supervise.supervisor.record import journal
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.history import policy_history, speed_of, story
from qlora_supervise.supervisor.record.journal import AttemptRecord, DecisionRecord, Outcome, Phase, RunState
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.trainers.trainer import saved_by_the_tool_only
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.events import ChildEvent, script_settings
from qlora_supervise.trainer_child.contract.script_knobs import as_built
from qlora_supervise.trainer_child.contract.spec import Knobs


@dataclasses.dataclass(frozen=True)
class Pending:
    """A failed attempt between its classification and its journal line."""

    outcome: AttemptOutcome
    failure: Failure
    record: AttemptRecord  # the line without its decision
    history: tuple[policy.PastAttempt, ...]  # what the policy was asked with (this attempt last)
    decision: policy.Decision
    waited: policy.WaitResult | None = None


@dataclasses.dataclass(frozen=True)
class Turn:
    """Where the arbiter goes next: a state, with what that state acts on."""

    state: RunState
    pending: Pending | None = None  # WAITING: the failed attempt whose answer waits
    plan: Plan | None = None  # RUNNING: the plan to run


@dataclasses.dataclass
class Conclusions:
    """The journal's writer; ``records``: the journal's lines, this run's appended as they are written."""

    job: Job
    rd: RunDir
    log: FilteringBoundLogger
    disk: DiskWaiter
    settings: policy.Settings  # the policy's, updated by what each attempt showed (lengths, peaks, speeds)
    lifted_after: int = 0  # attempts up to this one had a lifted verdict: the budgets count those after
    records: list[AttemptRecord] = dataclasses.field(default_factory=list)

    def _as_trained(self, o: AttemptOutcome) -> AttemptOutcome:
        """``o`` with the knobs the attempt trained with (the journal, the policy's history and the
        never-repeat-a-failed-config rule key on what ran): its speed trial's choice (whose reason
        joins the plan's), and what a script with its settings in its code reports it built."""
        trial = speed_of(o.progress.events, o.plan.knobs).choice
        trained = as_built(trial.knobs if trial else o.plan.knobs, script_settings(o.progress.events))
        o = dataclasses.replace(o, host_predicted=job_settings.predicted_host(self.settings, trained))
        note = o.plan.note
        if trial is not None:
            note = note and dataclasses.replace(note, why=(*note.why, trial.why))
        elif trained == o.plan.knobs:
            return o
        return dataclasses.replace(o, plan=dataclasses.replace(o.plan, knobs=trained, note=note))

    def conclude(self, o: AttemptOutcome, reclaimed: bool = False) -> Turn:
        """The one path from an ended attempt (watched or reclaimed) to its journal line."""
        o = self._as_trained(o)
        log = self.log.bind(attempt=o.number)
        # The memory model's peak for the knobs against the GPU budget (none for a merge, on the CPU).
        phase, rd = o.plan.phase, self.rd
        modelled = phase is Phase.TRAIN and self.job.resources.device != "cpu"
        shape, budget = self.settings.shape, self.settings.budget_bytes
        fit = predicted_fit(shape, o.plan.knobs, budget) if modelled else None
        # A tool without the shim saves into its own output dir only.
        saved_alone = phase is Phase.TRAIN and self.job.trainer.saved_alone(rd.root)
        verdict = judge(o, saved_alone or (rd.merged if phase is Phase.MERGE else rd.adapter).exists(), fit)
        if isinstance(verdict, Failure):
            verdict = self.disk.explain(verdict)
            log.info(  # what the classifier found, and from which evidence
                Event.FAILURE_CLASSIFIED,
                kind=verdict.kind.value,
                stage=verdict.stage.value,
                numbers=verdict.numbers_json(),
                evidence=verdict.evidence,
                message=verdict.message[:500],
                reclaimed=reclaimed,
                memory_snapshot=o.report.memory_snapshot if o.report else None,
                rank=verdict.rank,
                local_rank=verdict.local_rank,
                gpu=verdict.gpu,
            )
            return self._decide(o, verdict)
        if verdict is Outcome.STEPPED_UP and o.planned is not None:
            return self._planned(o, o.planned)
        next_from = None if verdict is Outcome.SUCCEEDED else self.resume_step(o.plan.knobs)
        record = self.journal(record_of(o, verdict, next_from), o.progress.events)
        if verdict is Outcome.STOPPED:
            return Turn(RunState.STOPPED)  # RUNNING -> STOPPED
        if verdict is Outcome.SUCCEEDED:
            steps = record.steps_completed
            log.info(Event.ATTEMPT_SUCCEEDED, phase=record.phase.value, steps=steps, reclaimed=reclaimed)
            if record.phase is Phase.MERGE or not self.job.train.merge:  # nothing (no merge) is left to run
                # The event names what is there, never an adapter folder that was not written.
                tool_output = saved_by_the_tool_only(rd.root, rd.adapter)
                log.info(
                    Event.RUN_SUCCEEDED,
                    attempts=record.attempt,
                    steps=max(r.steps_completed for r in self.records if r.phase is Phase.TRAIN),
                    adapter=str(rd.adapter) if rd.adapter.exists() else None,
                    trainer_output=str(tool_output) if tool_output is not None else None,
                    merged=str(rd.merged) if record.phase is Phase.MERGE else None,
                    story=story(self.records),
                )
        else:
            log.info(
                Event.ATTEMPT_INTERRUPTED,
                steps=record.steps_completed,
                resume_from=record.next_resume_from,
                why="the supervisor stopped while this attempt ran; its config is not counted as failed",
            )
        return Turn(RunState.STARTING)  # RUNNING -> STARTING: the plan says what is left (a merge, or done)

    def _planned(self, o: AttemptOutcome, planned: PlannedRestart) -> Turn:
        """A planned restart (a step-up or a re-time) journalled as the restart decision it is."""
        # Back to the 32-bit optimizer: its state starts afresh (the resume reads that off the checkpoint).
        survives = Survives.OPTIMIZER_RESET if "optimizer" in planned.changes else Survives.ALL
        entry = DecisionRecord(
            journal.Action.RESTART, planned.why, planned.rung, planned.changes, survives, planned.knobs,
            undoes=planned.undoes,
        )  # fmt: skip
        line = record_of(o, Outcome.STEPPED_UP, self.resume_step(planned.knobs), None, entry)
        self.journal(line, o.progress.events)
        return Turn(RunState.STARTING)  # RUNNING -> STARTING: the plan follows the decision

    def answer(self, pending: Pending) -> Turn:
        """Act on the policy's answer: a Wait is carried out first; a Restart or GiveUp is journalled."""
        decision = pending.decision
        if isinstance(decision, policy.Wait):
            return Turn(RunState.WAITING, pending)  # RUNNING -> WAITING
        next_from = None
        if isinstance(decision, policy.GiveUp):  # a memory give-up names the cap (issue 21 item 7)
            seen = [*self.records, pending.record]
            knobs = pending.outcome.plan.knobs
            decision = with_named_cap(decision, pending.failure.kind, knobs, self.job, self.settings, seen)
        if isinstance(decision, policy.Restart):
            reinit = decision.survives is Survives.ADAPTER_REINIT
            next_from = 0 if reinit else self.resume_step(decision.knobs)
        entry = DecisionRecord.of(decision, pending.waited.waited_s if pending.waited else 0.0)
        line = record_of(pending.outcome, Outcome.FAILED, next_from, pending.record.failure, entry)
        record = self.journal(line, pending.outcome.progress.events)
        self._announce_decision(self.log.bind(attempt=record.attempt), record)
        return _after(record)

    def after_wait(self, pending: Pending, waited: policy.WaitResult) -> Turn:
        """The policy asked again with what its Wait saw; a stop that ended the wait is no verdict."""
        o = pending.outcome
        if waited.stopped:
            # WAITING -> STOPPED: no verdict on the config; the run stays resumable.
            line = record_of(o, Outcome.STOPPED, self.resume_step(o.plan.knobs), pending.record.failure)
            self.journal(line, o.progress.events)
            return Turn(RunState.STOPPED)
        knobs, phase, history = o.plan.knobs, o.plan.phase.value, pending.history
        decision = policy.decide(pending.failure, knobs, history, self.settings, waited=waited, phase=phase)
        return self.answer(dataclasses.replace(pending, decision=decision, waited=waited))

    def journal(self, record: AttemptRecord, events: Sequence[ChildEvent]) -> AttemptRecord:
        """Append ``record`` to ``attempts.jsonl`` (fsynced) and to ``records``; ``events``: the attempt's."""
        journal.append_attempt(self.rd.attempts, record)
        self.records.append(record)
        speed = speed_of(events, record.knobs)
        self.settings = job_settings.remember_attempt(self.settings, self.job, record, speed)
        return record

    def resume_step(self, knobs: Knobs) -> int:
        """The step an attempt with ``knobs`` would resume from: the same rule the spawn uses."""
        return resume_point(self.rd.checkpoints, knobs).step

    def _decide(self, o: AttemptOutcome, failure: Failure) -> Turn:
        self.settings = job_settings.with_sample_lengths(self.settings, o.progress.events)
        self.settings = job_settings.with_script_model(self.settings, o.progress.events)
        if failure.kind is FailureKind.CHECKPOINT_DAMAGED and (quarantined := self._quarantine(o, failure)):
            return _after(quarantined)
        if failure.kind is FailureKind.DISK_FULL:
            failure = self.disk.with_room_needed(failure)
        # A lifted verdict starts the budgets afresh: the attempts before it were judged already.
        earlier = [r for r in self.records if r.attempt > self.lifted_after]
        # The policy's first answer, saying so when the OOM repeats at the attempt before's data position.
        record = record_of(o, Outcome.FAILED, None, failure_record(failure, o.report, o.progress))
        # The failure's own kind even for a damaged checkpoint that could not be moved aside:
        # later decisions leave that kind out of their budgets, but this one decides about it.
        this = dataclasses.replace(policy_history([record])[0], kind=failure.kind)
        history = (*policy_history(earlier), this)
        decision = policy.decide(failure, o.plan.knobs, history, self.settings, phase=o.plan.phase.value)
        before = next((r.failure for r in reversed(earlier) if r.failure is not None), None)
        note = repeat_note(failure, before, o.plan.knobs.max_seq_len, self.settings.sample_lengths)
        if note is not None and not isinstance(decision, policy.Wait):
            decision = dataclasses.replace(decision, why=f"{decision.why}; {note}")
        return self.answer(Pending(o, failure, record, history, decision))

    def _quarantine(self, o: AttemptOutcome, failure: Failure) -> AttemptRecord | None:
        """The checkpoint the child could not load is moved aside and the same knobs resume from
        the next older one (no verdict on the config); None when it cannot be moved."""
        if (moved := quarantine_reported(o.report, self.rd.checkpoints)) is None:
            return None
        log = self.log.bind(attempt=o.number)
        log_quarantined(log, [moved])
        entry = DecisionRecord.retry_from_older(o.plan.knobs, moved.path.name)
        resume = self.resume_step(o.plan.knobs)
        line = record_of(o, Outcome.FAILED, resume, failure_record(failure, o.report), entry)
        record = self.journal(line, o.progress.events)
        self._announce_decision(log, record)
        return record

    def _announce_decision(self, log: FilteringBoundLogger, record: AttemptRecord) -> None:
        """``retry`` (a warning) or ``gave_up`` (an error), read from the journal line alone."""
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
            journal=str(self.rd.attempts),
            story=story(self.records),
        )


def _after(record: AttemptRecord) -> Turn:
    """BACKOFF only before an unchanged retry with no wait in between (RUNNING | WAITING -> ...)."""
    decision = record.decision
    if record.restarts and decision is not None and decision.knobs == record.knobs and not decision.waited_s:
        return Turn(RunState.BACKOFF)  # the same config again
    return Turn(RunState.STARTING)  # a new config, or the verdict
