"""How long a recovery took: from an attempt's failure to the next attempt's first step.

The supervisor's own measure of what an OOM costs (the warm spare's reason to exist), logged as
``first_step`` for every attempt, so a person and the benchmark read the same number.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.trainer_child.contract.events import ChildEvent, Heartbeat
from qlora_supervise.trainer_child.contract.report import ErrorReport


@dataclasses.dataclass
class FirstStep:
    """Logs ``first_step`` once: the attempt's first completed optimizer step, timed from its
    start and from the previous attempt's failure (what recovery costs, spare or not)."""

    resumed_from: int
    started_at: float  # wall clock
    failed_at: float | None
    warm_spare: bool
    seen: bool = False

    def note(self, events: Sequence[ChildEvent], log: FilteringBoundLogger) -> bool:
        """Log ``first_step`` if ``events`` hold it; True when they did."""
        if self.seen:
            return False
        for event in events:
            if not isinstance(event, Heartbeat):
                continue
            step, at = event.step, event.time
            if step <= self.resumed_from or at is None:
                continue
            self.seen = True
            log.info(
                Event.FIRST_STEP,
                step=step,
                warm_spare=self.warm_spare,
                since_spawn_s=round(at - self.started_at, 2),
                **({} if self.failed_at is None else {"since_failure_s": round(at - self.failed_at, 2)}),
            )
            return True
        return False


def failure_time(report: ErrorReport | None, ended_at: float) -> float:
    """When the attempt failed: the time its report gives (when the child caught the exception),
    else (no report: a SIGKILL, a hang) the end of the watch."""
    return ended_at if report is None else report.time
