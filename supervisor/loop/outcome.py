"""What an ended attempt showed (watched, or reclaimed after the supervisor died), and the one path
for both to a verdict (:func:`judge`) and a journal line (:func:`record_of`)."""

from __future__ import annotations

import dataclasses

from qlora_supervise.supervisor.diagnosis import classify
from qlora_supervise.supervisor.diagnosis.fragmentation import StepFit
from qlora_supervise.supervisor.facts.failure import ChildExit, Failure, KilledBy
from qlora_supervise.supervisor.loop.climb_back import PlannedRestart
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.record import journal
from qlora_supervise.supervisor.record.journal import AttemptRecord, DecisionRecord, Outcome
from qlora_supervise.supervisor.watching.watch import Progress, Watched
from qlora_supervise.trainer_child.contract.codes import ExitCode, FailureKind, Stage
from qlora_supervise.trainer_child.contract.events import Resumed, script_settings
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.script_knobs import unapplied


@dataclasses.dataclass(frozen=True)
class AttemptOutcome:
    """An ended attempt, before any verdict. ``exit`` is None when nobody saw the child exit."""

    number: int
    plan: Plan
    exit: ChildExit | None
    progress: Progress
    report: ErrorReport | None
    memory: Watched  # what the supervisor sampled while it ran (None fields: no reading)
    resumed_from: int
    started_at: float
    ended_at: float
    log_tail: str
    oom_kill_delta: int = 0
    host_predicted: int | None = None  # the host model's training peak for the plan's knobs
    reports: tuple[ErrorReport, ...] = ()  # torchrun: every rank's (``report`` is the cause); else empty
    planned: PlannedRestart | None = None  # stopped at a checkpoint for a faster config (climb_back.py)

    @property
    def steps_completed(self) -> int:
        """The last optimizer step this attempt itself finished; 0 when it trained none (a child
        that resumed at S and failed before S + 1 still reports S: an earlier attempt's step)."""
        last = max(self.progress.step, self.report.step if self.report else 0)
        return last if last > self.resumed_from else 0


def judge(o: AttemptOutcome, phase_done: bool, fit: StepFit | None = None) -> Outcome | Failure:
    """Succeeded, stopped, interrupted (no verdict on the config), or a classified failure; under
    torchrun it names the rank (and local rank: its GPU) that caused it. ``fit``: the memory model's
    peak for the knobs against the budget (fragmentation is judged on it)."""
    verdict = _judge(o, phase_done, fit)
    if not isinstance(verdict, Failure):
        return verdict
    if o.report is not None and o.report.world_size > 1:
        reports = o.reports or (o.report,)
        cause = classify.first_failure(reports)
        why = f"{cause.why}; {verdict.evidence}" if cause is not None else verdict.evidence
        rank, local = o.report.rank, o.report.local_rank
        # Every report a knock-on and one rank without one: it died first and broke the others' collective.
        silent = set(range(reports[0].world_size)) - {r.rank for r in reports}
        if len(silent) == 1 and all(classify.is_knock_on(r) for r in reports):
            rank = local = silent.pop()  # one host (torchrun --standalone): the rank is its local rank
            why = f"{why}; rank {rank} left no report: it died first"
        verdict = dataclasses.replace(verdict, rank=rank, local_rank=local, evidence=why)
    elif verdict.local_rank is None and verdict.fatal_xid is not None:
        # A GPU fault no rank reported: the rank whose card NVML saw the fatal Xid on.
        ranks = [rank for rank, xids in sorted(o.memory.card_xids.items()) if verdict.fatal_xid in xids]
        if len(ranks) == 1:
            why = f"{verdict.evidence}; NVML saw Xid {verdict.fatal_xid} on local rank {ranks[0]}'s card"
            verdict = dataclasses.replace(verdict, rank=ranks[0], local_rank=ranks[0], evidence=why)
    elif o.plan.knobs.world_size > 1 and verdict.local_rank is None:
        # No rank reported: the rank whose process left first, else the one torchrun's summary names.
        first = sorted(o.memory.rank_exits.items(), key=lambda item: item[1])
        root: int | None
        if first and (len(first) == 1 or first[0][1] < first[1][1]):
            root, whose = first[0][0], "its process left first"
        else:
            root, whose = classify.torchrun_root_rank(o.log_tail), "torchrun saw it fail first"
        if root is not None:
            why = f"{verdict.evidence}; rank {root} failed and no rank reported: {whose}"
            verdict = dataclasses.replace(verdict, rank=root, local_rank=root, evidence=why)
    gpu = o.memory.cards.get(verdict.local_rank) if verdict.local_rank is not None else None
    if gpu is None:
        return verdict
    # The failing rank's card by its NVML (physical) index, in the record and the evidence.
    why = f"{verdict.evidence} (local rank {verdict.local_rank} trains on GPU {gpu}, NVML index)"
    return dataclasses.replace(verdict, gpu=gpu, evidence=why)


def _judge(o: AttemptOutcome, phase_done: bool, fit: StepFit | None) -> Outcome | Failure:
    exit_, report = o.exit, o.report
    # A report of a real failure (not of the graceful stop we asked for).
    failed = report is not None and report.exit_code not in (ExitCode.OK, ExitCode.STOPPED)
    if exit_ is None:
        if failed and report is not None:
            # The child failed while nobody watched: classify it as if we had seen it exit.
            unseen = ChildExit(report.exit_code, None, None, 0.0)
            return classify.classify_exit(unseen, report, o.log_tail, fit=fit)
        return Outcome.SUCCEEDED if o.progress.finished and phase_done else Outcome.INTERRUPTED
    if exit_.killed_by_supervisor is KilledBy.STEP_UP and o.planned is not None and not failed:
        return Outcome.STEPPED_UP
    # A child stopped for a hang also exits STOPPED (it checkpoints on SIGTERM): that is a hang.
    ours = exit_.killed_by_supervisor is KilledBy.STOP and not failed
    if ours or (exit_.killed_by_supervisor is None and exit_.returncode == ExitCode.STOPPED):
        return Outcome.STOPPED
    if exit_.returncode == 0 and phase_done:
        return Outcome.SUCCEEDED
    return classify.classify_exit(
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
        peak=journal.attempt_peak(
            o.report.allocator_peak.allocated_bytes if o.report and o.report.allocator_peak else None,
            o.report.oom_numbers.step_need_bytes if o.report else None,
            o.progress.peak_bytes,
            o.memory.gpu_peak_process,
            o.memory.rss_peak,
        ),
        failure=failure,
        decision=decision,
        plan=o.plan.note,
        optimizer_reset=optimizer_reset(o.progress),
        host=journal.HostMemory(
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
