"""An attempt's measured speed: the tokens/s its heartbeats carried, for the knobs it trained with.

The child's heartbeats carry the tokens/s of its latest optimizer step; the attempt's speed is
their median (the first step's kernel tuning and a checkpoint's pause are outliers). When the
speed trial ran, the knobs are the policy's choice among its timings (``policies.choice``), not the plan's.
Used by ``status``, ``explain`` and the run summary, by the per-host store, and within a run to
correct the throughput model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlora_supervise.policies.choice import TrialChoice, after_trial, trained_with
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.policies.search import throughput
from qlora_supervise.supervisor.record.records import AttemptRecord
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract.events import (
    ChildEvent,
    Heartbeat,
    SpeedTrialEvent,
    TrialResult,
    read_events,
)
from qlora_supervise.trainer_child.contract.spec import Knobs


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
    rates: list[float] = []
    trial = None
    for event in events:
        if isinstance(event, Heartbeat) and event.tokens_per_s is not None and event.tokens_per_s > 0:
            rates.append(event.tokens_per_s)
        elif isinstance(event, SpeedTrialEvent):
            trial = event
    choice = None if trial is None else after_trial(planned, trial.results)
    return AttemptSpeed(choice.knobs if choice else planned, _median(rates), len(rates), trial, choice)


def read_attempt_speed(events_file: Path, planned: Knobs) -> AttemptSpeed:
    """The speed in ``events_file`` (an unreadable or missing file is an attempt with no speed)."""
    return speed_of(read_events(events_file), planned)


def _median(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def trial_speeds(speed: AttemptSpeed, planned: Knobs) -> list[tuple[Knobs, float]]:
    """The speed trial's measured candidates as (knobs, tokens/s). Forward + backward micro-steps
    without the optimizer step, so a little above a training step's rate: the attempt's own
    heartbeats, stored after them, correct the chosen one."""
    if speed.trial is None:
        return []
    out = []
    for result in speed.trial.results:
        if result.tokens_per_s is None or result.error is not None:
            continue
        out.append((trained_with(planned, result.candidate), result.tokens_per_s))
    return out


def measured_speed(rd: RunDir, record: AttemptRecord) -> AttemptSpeed:
    """The speed of a journalled attempt, from its events file in the run directory."""
    return read_attempt_speed(rd.attempt(record.attempt).events, record.knobs)


def speed_line(speed: AttemptSpeed) -> str | None:
    """``status``'s line for an attempt's speed (None: it measured no step), with the speed trial's
    table when it ran one."""
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
