"""What an ended attempt showed (watched, or reclaimed after the supervisor died), and the one path
for both to a verdict (:func:`judge`), a journal line (:func:`record_of`) and the arbiter's next
state (:class:`Conclusions`). The policy is asked with the failed attempt's journal line, so what
it weighed and what the journal keeps cannot differ; a decision is journalled before it is acted on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from structlog.typing import FilteringBoundLogger

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.rungs import Survives
from qlora_supervise.supervisor.diagnosis.cap_advice import with_named_cap
from qlora_supervise.supervisor.diagnosis.classify import classify_exit
from qlora_supervise.supervisor.diagnosis.fragmentation import StepFit
from qlora_supervise.supervisor.diagnosis.ranks import first_failure, is_knock_on, torchrun_root_rank
from qlora_supervise.supervisor.diagnosis.repeat import repeat_note
from qlora_supervise.supervisor.facts.failure import ChildExit, Failure, KilledBy
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.loop import settings as job_settings
from qlora_supervise.supervisor.loop.climb_back import PlannedRestart
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.loop.resume import log_quarantined, quarantine_reported, resume_point
from qlora_supervise.supervisor.loop.waiting import DiskWaiter
from qlora_supervise.supervisor.record.attempt_speed import speed_of
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.history import policy_history, story
from qlora_supervise.supervisor.record.journal import RunState, append_attempt
from qlora_supervise.supervisor.record.records import (
    Action,
    AttemptRecord,
    DecisionRecord,
    HostMemory,
    Outcome,
    Phase,
    attempt_peak,
)
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.trainers.trainer import saved_by_the_tool_only
from qlora_supervise.supervisor.watching.heartbeats import Progress
from qlora_supervise.trainer_child.contract.codes import ExitCode, FailureKind, Stage
from qlora_supervise.trainer_child.contract.events import ChildEvent, Resumed, script_settings
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.script_knobs import as_built, unapplied
from qlora_supervise.trainer_child.contract.spec import Knobs


@dataclass(frozen=True)
class MemorySeen:
    """What the supervisor sampled while the attempt ran (None: no reading)."""

    nvml_peak: int | None = None
    gpu_others_at_end: int | None = None
    gpu_total: int | None = None
    rss_peak: int | None = None
    xid_events: tuple[int, ...] = ()
    # Under torchrun: local rank -> NVML index of its card, and the Xids seen on each card.
    cards: Mapping[int, int] = dataclasses.field(default_factory=dict)
    card_xids: Mapping[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class AttemptOutcome:
    """An ended attempt, before any verdict. ``exit`` is None when nobody saw the child exit."""

    number: int
    plan: Plan
    exit: ChildExit | None
    progress: Progress
    report: ErrorReport | None
    memory: MemorySeen
    resumed_from: int
    started_at: float
    ended_at: float
    log_tail: str
    oom_kill_delta: int = 0
    host_predicted: int | None = None  # the host model's training peak for the plan's knobs
    # Under torchrun, every rank's report (``report`` is the cause among them); empty otherwise.
    reports: tuple[ErrorReport, ...] = ()
    planned: PlannedRestart | None = None  # stopped at a checkpoint for a faster config (climb_back.py)
    # Under torchrun, when the supervisor first saw each rank's process gone (clock seconds).
    rank_exits: Mapping[int, float] = dataclasses.field(default_factory=dict)

    @property
    def steps_completed(self) -> int:
        """The last optimizer step this attempt itself finished; 0 when it trained none (a child
        that resumed at S and failed before S + 1 still reports S: an earlier attempt's step)."""
        last = max(self.progress.step, self.report.step if self.report else 0)
        return last if last > self.resumed_from else 0


def failed_report(report: ErrorReport | None) -> bool:
    """A report of a real failure (not of the graceful stop we asked for)."""
    return report is not None and report.exit_code not in (ExitCode.OK, ExitCode.STOPPED)


def judge(o: AttemptOutcome, phase_done: bool, fit: StepFit | None = None) -> Outcome | Failure:
    """Succeeded, stopped, interrupted (no verdict on the config), or a classified failure; under
    torchrun it names the rank (and local rank: its GPU) that caused it. ``fit``: the memory model's
    peak for the knobs against the budget (fragmentation is judged on it)."""
    verdict = _judge(o, phase_done, fit)
    if not isinstance(verdict, Failure):
        return verdict
    if o.report is not None and o.report.world_size > 1:
        cause = first_failure(o.reports or (o.report,))
        why = f"{cause.why}; {verdict.evidence}" if cause is not None else verdict.evidence
        rank, local = o.report.rank, o.report.local_rank
        silent = _silent_rank(o.reports or (o.report,))
        if silent is not None:  # one host (torchrun --standalone): the rank is its local rank
            rank = local = silent
            why = f"{why}; rank {silent} left no report: it died first"
        verdict = dataclasses.replace(verdict, rank=rank, local_rank=local, evidence=why)
    elif verdict.local_rank is None and verdict.fatal_xid is not None:
        verdict = _xid_card(verdict, o.memory.card_xids)
    elif o.plan.knobs.world_size > 1 and verdict.local_rank is None:
        verdict = _root_rank(verdict, o.rank_exits, o.log_tail)
    return _named_card(verdict, o.memory.cards)


def _silent_rank(reports: tuple[ErrorReport, ...]) -> int | None:
    """The one rank that left no report when every report is a knock-on: it died first and broke
    the others' collective. None when a rank reported a cause of its own."""
    world = reports[0].world_size
    if any(not is_knock_on(r) for r in reports):
        return None
    silent = set(range(world)) - {r.rank for r in reports}
    return silent.pop() if len(silent) == 1 else None


def _root_rank(failure: Failure, rank_exits: Mapping[int, float], log_tail: str) -> Failure:
    """No rank reported: the rank whose process left first, else the one torchrun's summary names."""
    first = sorted(rank_exits.items(), key=lambda item: item[1])
    rank: int | None
    if first and (len(first) == 1 or first[0][1] < first[1][1]):
        rank, whose = first[0][0], "its process left first"
    else:
        rank, whose = torchrun_root_rank(log_tail), "torchrun saw it fail first"
    if rank is None:
        return failure
    why = f"{failure.evidence}; rank {rank} failed and no rank reported: {whose}"
    return dataclasses.replace(failure, rank=rank, local_rank=rank, evidence=why)


def _xid_card(failure: Failure, card_xids: Mapping[int, tuple[int, ...]]) -> Failure:
    """A GPU fault no rank reported: the rank whose card NVML saw the fatal Xid on."""
    ranks = [rank for rank, xids in sorted(card_xids.items()) if failure.fatal_xid in xids]
    if len(ranks) != 1:
        return failure
    why = f"{failure.evidence}; NVML saw Xid {failure.fatal_xid} on local rank {ranks[0]}'s card"
    return dataclasses.replace(failure, rank=ranks[0], local_rank=ranks[0], evidence=why)


def _named_card(failure: Failure, cards: Mapping[int, int]) -> Failure:
    """The failing rank's card by its NVML (physical) index, in the record and the evidence."""
    if failure.local_rank is None or failure.local_rank not in cards:
        return failure
    gpu = cards[failure.local_rank]
    why = f"{failure.evidence} (local rank {failure.local_rank} trains on GPU {gpu}, NVML index)"
    return dataclasses.replace(failure, gpu=gpu, evidence=why)


def _judge(o: AttemptOutcome, phase_done: bool, fit: StepFit | None) -> Outcome | Failure:
    exit_, failed = o.exit, failed_report(o.report)
    if exit_ is None:
        if failed and o.report is not None:
            # The child failed while nobody watched: classify it as if we had seen it exit.
            unseen = ChildExit(o.report.exit_code, None, None, 0.0)
            return classify_exit(unseen, o.report, o.log_tail, fit=fit)
        return Outcome.SUCCEEDED if o.progress.finished and phase_done else Outcome.INTERRUPTED
    if exit_.killed_by_supervisor is KilledBy.STEP_UP and o.planned is not None and not failed:
        return Outcome.STEPPED_UP
    # A child stopped for a hang also exits STOPPED (it checkpoints on SIGTERM): that is a hang.
    ours = exit_.killed_by_supervisor is KilledBy.STOP and not failed
    if ours or (exit_.killed_by_supervisor is None and exit_.returncode == ExitCode.STOPPED):
        return Outcome.STOPPED
    if exit_.returncode == 0 and phase_done:
        return Outcome.SUCCEEDED
    return classify_exit(
        exit_,
        o.report,
        o.log_tail,
        cgroup_oom_kills=o.oom_kill_delta,
        gpu_others_bytes=o.memory.gpu_others_at_end,
        gpu_total_bytes=o.memory.gpu_total,
        last_stage=Stage.named(o.progress.stage),
        last_step=o.progress.step,
        fit=fit,
        xid_events=o.memory.xid_events,
    )


def failure_record(failure: Failure, report: ErrorReport | None, progress: Progress | None = None) -> Failure:
    """The failure as the journal keeps it: the report's emergency checkpoint and allocator setting,
    the message cut short; for a host OOM kill, ``rss_at_kill`` and ``host_peak`` from the heartbeats."""
    if failure.kind is FailureKind.HOST_OOM and progress is not None:
        host = {"rss_at_kill": progress.last_rss, "host_peak": progress.host_peak}
        numbers = {**failure.numbers, **{k: v for k, v in host.items() if v is not None}}
        failure = dataclasses.replace(failure, numbers=numbers)
    return dataclasses.replace(
        failure,
        message=failure.message[:2000],
        emergency_checkpoint=report.emergency_checkpoint if report else None,
        expandable_segments_active=report.expandable_segments_active if report else None,
    )


def record_of(
    o: AttemptOutcome,
    outcome: Outcome,
    next_resume_from: int | None,
    failure: Failure | None = None,
    decision: DecisionRecord | None = None,
) -> AttemptRecord:
    """The journal line; lost steps are the finished steps the next attempt will not start from."""
    steps = o.steps_completed
    lost = max(0, steps - next_resume_from) if next_resume_from is not None else 0
    return AttemptRecord(
        attempt=o.number,
        phase=o.plan.phase,
        knobs=o.plan.knobs,
        outcome=outcome,
        started_at=o.started_at,
        ended_at=o.ended_at,
        exit_code=o.exit.returncode if o.exit else (o.report.exit_code if o.report else None),
        signal=o.exit.signal if o.exit else None,
        resumed_from=o.resumed_from,
        steps_completed=steps,
        next_resume_from=next_resume_from,
        lost_steps=lost,
        peak=attempt_peak(
            o.report.allocator_peak.allocated_bytes if o.report and o.report.allocator_peak else None,
            o.report.oom_numbers.step_need_bytes if o.report else None,
            o.progress.peak_bytes,
            o.memory.nvml_peak,
            o.memory.rss_peak,
        ),
        failure=failure,
        decision=decision,
        plan=o.plan.note,
        optimizer_reset=optimizer_reset(o.progress),
        host=HostMemory(
            o.progress.host_peak, o.progress.load_host_peak, o.progress.last_rss, o.host_predicted
        ),
        unapplied=unapplied(script_settings(o.progress.events)),
    )


def optimizer_reset(progress: Progress) -> str | None:
    """Why the child's ``resumed`` event says it reset the optimizer state; None if it did not."""
    resumed = next((e for e in progress.events if isinstance(e, Resumed)), None)
    if resumed is None or not resumed.reset_optimizer:
        return None
    return resumed.reset_reason or "the optimizer changed"


@dataclasses.dataclass(frozen=True)
class Pending:
    """A failed attempt between its classification and its journal line: ``record`` is the line
    without its decision, ``history`` what the policy was asked with (this attempt last)."""

    outcome: AttemptOutcome
    failure: Failure
    record: AttemptRecord
    history: tuple[policy.PastAttempt, ...]
    decision: policy.Decision
    waited: policy.WaitResult | None = None


@dataclasses.dataclass(frozen=True)
class Turn:
    """Where the arbiter goes next: a state, with what that state acts on (RUNNING: the plan to
    run; WAITING: the failed attempt whose answer waits)."""

    state: RunState
    pending: Pending | None = None
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

    def conclude(self, o: AttemptOutcome, records: list[AttemptRecord], reclaimed: bool = False) -> Turn:
        """The one path from an ended attempt (watched or reclaimed) to its journal line."""
        o = self._as_trained(o)
        log = self.log.bind(attempt=o.number)
        fit = job_settings.step_fit(self.settings, self.job.resources.device, o.plan)
        verdict = judge(o, self._phase_done(o.plan.phase), fit)
        if isinstance(verdict, Failure):
            verdict = self.disk.explain(verdict)
            _announce_failure(log, verdict, o.report, reclaimed)
            return self._decide(o, verdict, records, log)
        if verdict is Outcome.STEPPED_UP and o.planned is not None:
            return self._planned(o, o.planned, records)
        next_from = None if verdict is Outcome.SUCCEEDED else self.resume_step(o.plan.knobs)
        record = self.journal(record_of(o, verdict, next_from), records, o.progress.events)
        if verdict is Outcome.STOPPED:
            return Turn(RunState.STOPPED)  # RUNNING -> STOPPED
        if verdict is Outcome.SUCCEEDED:
            self._announce_success(log, record, records, reclaimed)
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
        line = record_of(o, Outcome.STEPPED_UP, self.resume_step(planned.knobs), None, entry)
        self.journal(line, records, o.progress.events)
        return Turn(RunState.STARTING)  # RUNNING -> STARTING: the plan follows the decision

    def answer(self, pending: Pending, records: list[AttemptRecord]) -> Turn:
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
        entry = DecisionRecord.of(decision, pending.waited.waited_s if pending.waited else 0.0)
        line = record_of(pending.outcome, Outcome.FAILED, next_from, pending.record.failure, entry)
        record = self.journal(line, records, pending.outcome.progress.events)
        self._announce_decision(self.log.bind(attempt=record.attempt), record, records)
        return _after(record)

    def after_wait(self, pending: Pending, waited: policy.WaitResult, records: list[AttemptRecord]) -> Turn:
        """The policy asked again with what its Wait saw; a stop that ended the wait is no verdict."""
        o = pending.outcome
        if waited.stopped:
            # WAITING -> STOPPED: no verdict on the config; the run stays resumable.
            line = record_of(o, Outcome.STOPPED, self.resume_step(o.plan.knobs), pending.record.failure)
            self.journal(line, records, o.progress.events)
            return Turn(RunState.STOPPED)
        knobs, phase = o.plan.knobs, o.plan.phase.value
        decision = policy.decide(
            pending.failure, knobs, pending.history, self.settings, waited=waited, phase=phase
        )
        return self.answer(dataclasses.replace(pending, decision=decision, waited=waited), records)

    def journal(
        self, record: AttemptRecord, records: list[AttemptRecord], events: Sequence[ChildEvent]
    ) -> AttemptRecord:
        """Append ``record`` to ``attempts.jsonl`` (fsynced) and to ``records``; ``events``: the
        attempt's, read once by its heartbeat reader."""
        append_attempt(self.rd.attempts, record)
        records.append(record)
        speed = speed_of(events, record.knobs)
        self.settings = job_settings.remember_attempt(self.settings, self.job, record, speed)
        return record

    def resume_step(self, knobs: Knobs) -> int:
        """The step an attempt with ``knobs`` would resume from: the same rule the spawn uses."""
        return resume_point(self.rd.checkpoints, knobs).step

    def _decide(
        self, o: AttemptOutcome, failure: Failure, records: list[AttemptRecord], log: FilteringBoundLogger
    ) -> Turn:
        self.settings = job_settings.with_sample_lengths(self.settings, o.progress.events)
        self.settings = job_settings.with_script_model(self.settings, o.progress.events)
        if failure.kind is FailureKind.CHECKPOINT_DAMAGED and (
            quarantined := self._quarantine(o, failure, records, log)
        ):
            return _after(quarantined)
        if failure.kind is FailureKind.DISK_FULL:
            failure = self.disk.with_room_needed(failure)
        # A lifted verdict starts the budgets afresh: the attempts before it were judged already.
        earlier = [r for r in records if r.attempt > self.lifted_after]
        return self.answer(self._ask(o, failure, earlier), records)

    def _ask(self, o: AttemptOutcome, failure: Failure, earlier: Sequence[AttemptRecord]) -> Pending:
        """The policy's first answer, saying so when the OOM repeats at the data position of the
        attempt before (:mod:`..diagnosis.repeat`)."""
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
        return Pending(o, failure, record, history, decision)

    def _quarantine(
        self, o: AttemptOutcome, failure: Failure, records: list[AttemptRecord], log: FilteringBoundLogger
    ) -> AttemptRecord | None:
        """The checkpoint the child could not load is moved aside and the same knobs resume from
        the next older one (no verdict on the config); None when it cannot be moved."""
        moved = quarantine_reported(o.report, self.rd.checkpoints)
        if moved is None:
            return None
        log_quarantined(log, [moved])
        entry = DecisionRecord.retry_from_older(o.plan.knobs, moved.path.name)
        line = record_of(
            o, Outcome.FAILED, self.resume_step(o.plan.knobs), failure_record(failure, o.report), entry
        )
        record = self.journal(line, records, o.progress.events)
        self._announce_decision(log, record, records)
        return record

    def _phase_done(self, phase: Phase) -> bool:
        if phase is Phase.TRAIN and self.job.trainer.saved_alone(self.rd.root):
            return True  # a tool without the shim saves into its own output dir only
        return (self.rd.merged if phase is Phase.MERGE else self.rd.adapter).exists()

    def _announce_success(
        self,
        log: FilteringBoundLogger,
        record: AttemptRecord,
        records: Sequence[AttemptRecord],
        reclaimed: bool,
    ) -> None:
        """``attempt_succeeded``, and ``run_succeeded`` when nothing (no merge) is left to run."""
        log.info(
            Event.ATTEMPT_SUCCEEDED,
            phase=record.phase.value,
            steps=record.steps_completed,
            reclaimed=reclaimed,
        )
        if record.phase is Phase.MERGE or not self.job.train.merge:
            rd = self.rd  # the event names what is there, never an adapter folder that was not written
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

    def _announce_decision(
        self, log: FilteringBoundLogger, record: AttemptRecord, records: Sequence[AttemptRecord]
    ) -> None:
        """``retry`` (a warning: the run goes on) or ``gave_up`` (an error), read from the journal
        line alone: what the log says is what the journal keeps."""
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
            story=story(records),
        )


def _announce_failure(
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


def _after(record: AttemptRecord) -> Turn:
    """BACKOFF only before an unchanged retry with no wait in between (RUNNING | WAITING -> ...)."""
    decision = record.decision
    if record.restarts and decision is not None and decision.knobs == record.knobs and not decision.waited_s:
        return Turn(RunState.BACKOFF)  # the same config again
    return Turn(RunState.STARTING)  # a new config, or the verdict
