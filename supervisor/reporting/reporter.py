"""The loop's one hook into reporting: each tick's progress goes to the console, systemd and metrics.

Events reach the metrics and the hook through the event log's listeners, so the loop knows nothing
of tqdm, sd_notify or Prometheus; the optional outputs run through :class:`~.outputs.BestEffort`."""

from __future__ import annotations

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.reporting.console import PaceMeter, ProgressDisplay
from qlora_supervise.supervisor.reporting.metrics import MetricsTextfile
from qlora_supervise.supervisor.reporting.notify import ServiceStatus
from qlora_supervise.supervisor.reporting.outputs import METRICS_TEXTFILE, SYSTEMD, BestEffort
from qlora_supervise.supervisor.watching.watch import Progress


class Reporter:
    """Fans one attempt's progress out to the console, sd_notify and (when on) the metrics file."""

    def __init__(
        self,
        display: ProgressDisplay,
        service: ServiceStatus | None = None,
        metrics: MetricsTextfile | None = None,
        outputs: BestEffort | None = None,
    ) -> None:
        self.display = display
        self.service = service
        self.metrics = metrics
        self.outputs = outputs or BestEffort()
        self._pace = PaceMeter()

    def update(self, attempt: int, progress: Progress, now: float) -> None:
        pace = self._pace.measure(attempt, progress, now)
        self.display.update(attempt, progress, pace)
        service, metrics = self.service, self.metrics
        if service is not None:
            self.outputs.run(SYSTEMD, lambda: service.update(attempt, progress, pace, now))
        if metrics is not None:
            self.outputs.run(METRICS_TEXTFILE, lambda: metrics.progress(attempt, progress, now))

    def bind(self, log: FilteringBoundLogger) -> None:
        """The event log exists: output failures go there; the metrics file gets its first state."""
        self.outputs.log = log
        metrics = self.metrics
        if metrics is not None:
            self.outputs.run(METRICS_TEXTFILE, metrics.write)

    def clear(self) -> None:
        self.display.clear()
