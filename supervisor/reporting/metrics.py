"""Prometheus metrics as a node_exporter textfile (``supervise.metrics_textfile``; off by default).

Why a textfile and not an HTTP endpoint: the supervisor is one single-threaded process per
job, and a lab server runs several jobs. An endpoint would need a port per job (and a thread
for ``prometheus_client``'s server inside the loop), a firewall rule to keep it on localhost,
and it vanishes with the process, taking the verdict with it. node_exporter already runs on
most lab servers and already serves ``--collector.textfile.directory``; a file per job needs no
port, is written atomically (``prometheus_client.write_to_textfile``: a temp file and a rename,
so a scrape never sees half a file), and its last state (succeeded, gave up) stays readable.

Metrics (label ``run``: the output_dir's name):

* ``qlora_supervise_attempts_total{outcome, kind}`` counter: attempts that ended (``kind`` is
  the failure kind, ``none`` for a success)
* ``qlora_supervise_step``, ``qlora_supervise_max_steps`` gauges
* ``qlora_supervise_tokens_per_second`` gauge
* ``qlora_supervise_peak_bytes`` gauge (this attempt), ``qlora_supervise_budget_bytes`` gauge
* ``qlora_supervise_state{qlora_supervise_state=...}`` enum: running, backoff, waiting,
  succeeded, gave_up, stopped
* ``qlora_supervise_attempt`` gauge: the attempt number now running

The file is an optional output: ``validate`` refuses one that cannot be created
(``jobfile.world.textfile_problem``), and a write that fails mid-run is the caller's to catch (the run goes
through :class:`~.outputs.BestEffort`, so a full or read-only textfile never stops training).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, write_to_textfile

from qlora_supervise.supervisor.jobfile.world import NOT_PROM
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.watching.heartbeats import Progress

STATES = ("starting", "running", "backoff", "waiting", "succeeded", "gave_up", "stopped")
_STATE_OF_EVENT = {
    Event.ATTEMPT_STARTED.value: "running",
    Event.BACKOFF.value: "backoff",
    Event.WAITING_FOR_MEMORY.value: "waiting",
    Event.RUN_SUCCEEDED.value: "succeeded",
    Event.GAVE_UP.value: "gave_up",
    Event.STOPPED.value: "stopped",
}
#: Progress is written at most this often; events (a retry, the verdict) are written at once.
WRITE_EVERY_S = 10.0


class MetricsTextfile:
    """The run's metrics, rewritten atomically to ``path`` (which must end in ``.prom``).

    Nothing is written until the first :meth:`write` (the caller's, through its best-effort guard).
    """

    def __init__(self, path: Path, run: str, budget_bytes: int | None) -> None:
        if path.suffix != ".prom":
            raise ValueError(f"{path}: {NOT_PROM}")
        self.path = path
        self.registry = CollectorRegistry()
        labels = ["run"]
        self._attempts = Counter(
            "qlora_supervise_attempts",
            "Attempts that ended, by outcome and failure kind",
            [*labels, "outcome", "kind"],
            registry=self.registry,
        )
        self._step = self._gauge("step", "Last completed optimizer step", labels)
        self._max_steps = self._gauge("max_steps", "Steps the run trains to", labels)
        self._tokens = self._gauge("tokens_per_second", "Training throughput of this attempt", labels)
        self._peak = self._gauge("peak_bytes", "Peak memory of this attempt (what its cap limits)", labels)
        self._budget = self._gauge("budget_bytes", "The memory cap the job gives the trainer", labels)
        self._attempt = self._gauge("attempt", "The attempt number running now", labels)
        self._state = Enum(
            "qlora_supervise_state", "Supervisor state", labels, states=list(STATES), registry=self.registry
        )
        self._run = run
        self._written_at = -1e18
        self._state.labels(run).state("starting")
        if budget_bytes is not None:
            self._budget.labels(run).set(budget_bytes)

    def _gauge(self, name: str, doc: str, labels: list[str]) -> Gauge:
        return Gauge(f"qlora_supervise_{name}", doc, labels, registry=self.registry)

    def progress(self, attempt: int, p: Progress, now: float) -> bool:
        """The attempt's progress (from the runner's tick), written every :data:`WRITE_EVERY_S`.

        False when no write was due (the gauges changed in memory only).
        """
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
        """An event of the run's log: attempt outcomes and state changes, written at once.

        False for an event the metrics do not count (nothing written).
        """
        name = str(event.get("event"))
        if name == Event.FAILURE_CLASSIFIED.value:
            self._attempts.labels(self._run, "failed", str(event.get("kind"))).inc()
        elif name == Event.ATTEMPT_SUCCEEDED.value:
            self._attempts.labels(self._run, "succeeded", "none").inc()
        elif name not in _STATE_OF_EVENT:
            return False
        if name in _STATE_OF_EVENT:
            self._state.labels(self._run).state(_STATE_OF_EVENT[name])
        self.write()
        return True

    def write(self) -> None:
        """The whole file, atomically (a temp file and a rename). Raises what the file system raises."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(self.path), self.registry)
