"""Memory creep during an attempt: the forecast from each heartbeat, its log line, and the early
checkpoint it asks the child for (watching/creep.py holds the rule itself)."""

from __future__ import annotations

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.loop.seams import Seams
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.reporting.reporter import Reporter
from qlora_supervise.supervisor.watching.creep import CreepWatch
from qlora_supervise.supervisor.watching.watch import Watched
from qlora_supervise.trainer_child.contract.events import ChildEvent, Heartbeat
from qlora_supervise.trainer_child.contract.spec import EARLY_CHECKPOINT_SIGNAL


def note_creep(
    events: list[ChildEvent],
    creep: CreepWatch,
    pid: int,
    seams: Seams,
    display: Reporter,
    log: FilteringBoundLogger,
    watched: Watched,
) -> None:
    """Feed new heartbeats to the creep rule; once it fires, log it and ask for a checkpoint."""
    for event in events:
        forecast = creep.observe(event) if isinstance(event, Heartbeat) else None
        if forecast is None:
            continue
        if forecast.asks_for_checkpoint:
            seams.signal_child(pid, EARLY_CHECKPOINT_SIGNAL)
        watched.creep = forecast
        display.clear()
        log.warning(
            Event.MEMORY_CREEP,
            step=forecast.step,
            peak_bytes=forecast.peak_bytes,
            slope_bytes_per_step=round(forecast.slope_bytes_per_step),
            budget_bytes=forecast.budget_bytes,
            predicted_oom_step=forecast.predicted_oom_step,
            window_steps=forecast.window_steps,
            early_checkpoint_requested=forecast.asks_for_checkpoint,
        )
