"""The loop's one hook into reporting: each tick's progress goes to the console, systemd and metrics.

The runner calls :meth:`Reporter.update` every tick and :meth:`Reporter.clear` before it logs;
events reach the metrics and the ``on_event`` hook through the event log's listeners
(:func:`~qlora_supervise.supervisor.record.eventlog.open_event_log`), so the loop itself knows
nothing of tqdm, sd_notify or Prometheus.
"""

from __future__ import annotations

from qlora_supervise.supervisor.reporting.console import ProgressDisplay
from qlora_supervise.supervisor.reporting.metrics import MetricsTextfile
from qlora_supervise.supervisor.reporting.pace import PaceMeter
from qlora_supervise.supervisor.reporting.service import ServiceStatus
from qlora_supervise.supervisor.watching.heartbeats import Progress


class Reporter:
    """Fans one attempt's progress out to the console, sd_notify and (when on) the metrics file."""

    def __init__(
        self,
        display: ProgressDisplay,
        service: ServiceStatus | None = None,
        metrics: MetricsTextfile | None = None,
    ) -> None:
        self.display = display
        self.service = service
        self.metrics = metrics
        self._pace = PaceMeter()

    def update(self, attempt: int, progress: Progress, now: float) -> None:
        pace = self._pace.measure(attempt, progress, now)
        self.display.update(attempt, progress, pace)
        if self.service is not None:
            self.service.update(attempt, progress, pace, now)
        if self.metrics is not None:
            self.metrics.progress(attempt, progress, now)

    def clear(self) -> None:
        self.display.clear()
