"""The journal as others read it: the policy's view of past attempts, the story of a run, and each
attempt's measured speed: the median tokens/s of its heartbeats (the first step's kernel tuning and a
checkpoint's pause are outliers), for the knobs it trained with (the speed trial's choice applied)."""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.choice import RETIME_RUNG, TrialChoice, after_trial, trained_with
from qlora_supervise.policies.ladder.step_up import STEP_UP_RUNG
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.policies.search import throughput
from qlora_supervise.supervisor.record.journal import AttemptRecord, Phase
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract import events as child_events
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.events import ChildEvent, Heartbeat, SpeedTrialEvent, TrialResult
from qlora_supervise.trainer_child.contract.spec import Knobs

#: The planned restarts to a faster config (issue 34), by the rung the journal names them with.
PLANNED_RUNGS = (STEP_UP_RUNG, RETIME_RUNG)


def policy_history(records: Sequence[AttemptRecord]) -> list[policy.PastAttempt]:
    """Every journalled attempt as the policy sees it (kind None: it did not fail; a checkpoint
    that would not load is no failure of the config)."""
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


def config_text(k: Knobs) -> str:
    """A config in one line, as status and explain show it."""
    ranks = f" x ranks {k.world_size}{' (FSDP)' if k.fsdp else ''}" if k.world_size > 1 else ""
    batch = f"micro_batch {k.micro_batch_size} x accum {k.grad_accum}{ranks}, seq_len {k.max_seq_len}"
    return f"{batch}, grad_ckpt {'on' if k.gradient_checkpointing else 'off'}, {k.optimizer}, r {k.lora_r}"


@dataclass(frozen=True)
class ConfigTime:
    """The wall time and the steps a run's training attempts spent in one config."""

    knobs: Knobs
    seconds: float
    steps: int

    def to_json(self) -> dict[str, Any]:
        return {"config": config_text(self.knobs), "seconds": round(self.seconds, 1), "steps": self.steps}


def time_in_configs(records: Sequence[AttemptRecord]) -> list[ConfigTime]:
    """The training attempts' time and steps per config, in the order the configs first ran."""
    seen: dict[Knobs, ConfigTime] = {}
    for r in [r for r in records if r.phase is Phase.TRAIN]:
        was = seen.get(r.knobs, ConfigTime(r.knobs, 0.0, 0))
        seconds, steps = was.seconds + r.ended_at - r.started_at, was.steps + r.steps_progressed
        seen[r.knobs] = ConfigTime(r.knobs, seconds, steps)
    return list(seen.values())


def planned_restarts(records: Sequence[AttemptRecord]) -> dict[str, int]:
    """How many step-ups and re-times the run took."""
    rungs = [r.decision.rung for r in records if r.decision is not None]
    return {rung: rungs.count(rung) for rung in PLANNED_RUNGS}


def climb_back_lines(planned: dict[str, int], configs: Sequence[dict[str, Any]]) -> list[str]:
    """status and explain: the planned restarts and the time in each config, from their JSON forms;
    none without a planned restart."""
    if not any(planned.values()):
        return []
    ups, retimes = planned.get(STEP_UP_RUNG, 0), planned.get(RETIME_RUNG, 0)
    return [f"step-ups: {ups}, speed trials timed again: {retimes}", "time in each config:"] + [
        f"  {_clock(c['seconds'])}, {c['steps']} step(s): {c['config']}" for c in configs
    ]


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"


@dataclass(frozen=True)
class AttemptSpeed:
    """What one attempt's events say about its speed."""

    knobs: Knobs  # the knobs it trained with (the speed trial's choice applied)
    tokens_per_s: float | None  # median over its heartbeats; None: no step measured
    beats: int  # heartbeats with a tokens/s
    trial: SpeedTrialEvent | None = None
    choice: TrialChoice | None = None  # the policy's, among the trial's timings


def speed_of(events: Iterable[ChildEvent], planned: Knobs) -> AttemptSpeed:
    """The speed the events of an attempt planned with ``planned`` say it trained at."""
    seen = list(events)
    beats = [e.tokens_per_s for e in seen if isinstance(e, Heartbeat)]
    rates = [rate for rate in beats if rate is not None and rate > 0]
    trial = next((e for e in reversed(seen) if isinstance(e, SpeedTrialEvent)), None)
    choice = None if trial is None else after_trial(planned, trial.results)
    median = statistics.median(rates) if rates else None
    return AttemptSpeed(choice.knobs if choice else planned, median, len(rates), trial, choice)


def read_attempt_speed(events_file: Path, planned: Knobs) -> AttemptSpeed:
    """The speed in ``events_file`` (an unreadable or missing file is an attempt with no speed)."""
    return speed_of(child_events.read_events(events_file), planned)


def trial_speeds(speed: AttemptSpeed, planned: Knobs) -> list[tuple[Knobs, float]]:
    """The speed trial's measured candidates as (knobs, tokens/s): without the optimizer step, a
    little above a training step's rate (the attempt's heartbeats, stored after, correct it)."""
    results = speed.trial.results if speed.trial is not None else ()
    return [
        (trained_with(planned, r.candidate), r.tokens_per_s)
        for r in results
        if r.tokens_per_s is not None and r.error is None
    ]


def measured_speed(rd: RunDir, record: AttemptRecord) -> AttemptSpeed:
    """The speed of a journalled attempt, from its events file in the run directory."""
    return read_attempt_speed(rd.attempt(record.attempt).events, record.knobs)


def speed_line(speed: AttemptSpeed) -> str | None:
    """``status``'s line for an attempt's speed and its speed trial (None: neither measured)."""
    if speed.tokens_per_s is None and speed.trial is None:
        return None
    parts = []
    if speed.tokens_per_s is not None:
        parts.append(f"{speed.tokens_per_s:.0f} tokens/s (median of {speed.beats} heartbeat(s))")
    if speed.trial is not None and speed.trial.abandoned is not None:
        parts.append(f"speed trial abandoned, kept the plan: {speed.trial.abandoned}")
    elif speed.trial is not None and speed.choice is not None:
        rows = ", ".join(_trial_row(t) for t in speed.trial.results)
        verdict = "switched" if speed.choice.switched else "kept the plan"
        parts.append(f"speed trial {speed.trial.seconds:.1f} s, {verdict}: {rows}")
    return "  speed: " + "; ".join(parts)


def _trial_row(t: TrialResult) -> str:
    mode = "ckpt" if t.candidate.gradient_checkpointing else "no-ckpt"
    value = f"{t.tokens_per_s:.0f}" if t.tokens_per_s is not None else (t.error or "-")
    if t.tokens_per_s is not None and t.error is not None:  # it ran, but measured over the limit
        value += f" (dropped: {t.error})"
    return f"micro {t.candidate.micro_batch_size} {mode} {value}"


def speed_columns(shape: ModelShape | None, speed: AttemptSpeed) -> dict[str, float | None]:
    """``explain --json``'s measured and predicted tokens/s (predicted: None without a shape)."""
    predicted = None if shape is None else round(throughput.predict(shape, speed.knobs).tokens_per_s, 1)
    measured = None if speed.tokens_per_s is None else round(speed.tokens_per_s, 1)
    return {"tokens_per_s": measured, "predicted_tokens_per_s": predicted}


def speed_cell(row: Mapping[str, Any]) -> str:
    """``explain``'s table cell: measured tokens/s, the prediction in brackets."""
    measured, predicted = row.get("tokens_per_s"), row.get("predicted_tokens_per_s")
    cell = "?" if measured is None else f"{measured:.0f}"
    return cell + ("" if predicted is None else f" ({predicted:.0f})")
