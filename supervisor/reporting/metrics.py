"""Prometheus metrics as a node_exporter textfile (``supervise.metrics_textfile``; off by default), label
``run``: the output_dir's name. A textfile, not an HTTP endpoint: an endpoint would need a port and a
server thread per job, and would vanish with the process, verdict and all; the file, written atomically,
keeps its last state. A write that fails mid-run goes through :class:`~.outputs.BestEffort`."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, write_to_textfile

from qlora_supervise.supervisor.jobfile.world import NOT_PROM
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.watching.watch import Progress

STATES = ("starting", "running", "backoff", "waiting", "succeeded", "gave_up", "stopped")
_STATE_OF_EVENT = {
    Event.ATTEMPT_STARTED.value: "running",
    Event.BACKOFF.value: "backoff",
    Event.WAITING_FOR_MEMORY.value: "waiting",
    Event.RUN_SUCCEEDED.value: "succeeded",
    Event.GAVE_UP.value: "gave_up",
    Event.STOPPED.value: "stopped",
}
_Metric = TypeVar("_Metric", Counter, Gauge)
#: Progress is written at most this often; events (a retry, the verdict) are written at once.
WRITE_EVERY_S = 10.0


class MetricsTextfile:
    """The run's metrics, rewritten atomically to ``path`` (``.prom``) from the first :meth:`write`."""

    def __init__(self, path: Path, run: str, budget_bytes: int | None) -> None:
        if path.suffix != ".prom":
            raise ValueError(f"{path}: {NOT_PROM}")
        self.path = path
        self.registry = CollectorRegistry()
        self._attempts = self._metric(
            Counter, "attempts", "Attempts that ended, by outcome and failure kind", "outcome", "kind"
        )
        self._planned = self._metric(
            Counter,
            "planned_restarts",
            "Planned restarts to a faster config: step_up (a rung's cause cleared), retime (the trial again)",
            "kind",
        )
        self._step = self._metric(Gauge, "step", "Last completed optimizer step")
        self._max_steps = self._metric(Gauge, "max_steps", "Steps the run trains to")
        self._tokens = self._metric(Gauge, "tokens_per_second", "Training throughput of this attempt")
        self._peak = self._metric(Gauge, "peak_bytes", "Peak memory of this attempt (what its cap limits)")
        self._budget = self._metric(Gauge, "budget_bytes", "The memory cap the job gives the trainer")
        self._attempt = self._metric(Gauge, "attempt", "The attempt number running now")
        self._state = Enum(
            "qlora_supervise_state", "Supervisor state", ["run"], states=list(STATES), registry=self.registry
        )
        self._run = run
        self._written_at = -1e18
        self._state.labels(run).state("starting")
        if budget_bytes is not None:
            self._budget.labels(run).set(budget_bytes)

    def _metric(self, kind: type[_Metric], name: str, doc: str, *labels: str) -> _Metric:
        return kind(f"qlora_supervise_{name}", doc, ["run", *labels], registry=self.registry)

    def progress(self, attempt: int, p: Progress, now: float) -> bool:
        """The attempt's progress, written every :data:`WRITE_EVERY_S`; False when no write was due."""
        run = self._run
        self._attempt.labels(run).set(attempt)
        self._step.labels(run).set(p.step)
        if p.max_steps:
            self._max_steps.labels(run).set(p.max_steps)
        if p.tokens_per_s is not None:
            self._tokens.labels(run).set(p.tokens_per_s)
        if p.peak_bytes:
            self._peak.labels(run).set(p.peak_bytes)
        if now - self._written_at < WRITE_EVERY_S:
            return False
        self._written_at = now  # first: a failing write is tried again in WRITE_EVERY_S, not every tick
        self.write()
        return True

    def on_event(self, event: Mapping[str, object]) -> bool:
        """Attempt outcomes and state changes, written at once; False for an event not counted."""
        name = str(event.get("event"))
        if name == Event.FAILURE_CLASSIFIED.value:
            self._attempts.labels(self._run, "failed", str(event.get("kind"))).inc()
        elif name == Event.ATTEMPT_SUCCEEDED.value:
            self._attempts.labels(self._run, "succeeded", "none").inc()
        elif name in (Event.STEP_UP.value, Event.RETIME.value):
            self._planned.labels(self._run, name).inc()
        elif name not in _STATE_OF_EVENT:
            return False
        if name in _STATE_OF_EVENT:
            self._state.labels(self._run).state(_STATE_OF_EVENT[name])
        self.write()
        return True

    def write(self) -> None:
        """The whole file, atomically. Raises what the file system raises."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(self.path), self.registry)
