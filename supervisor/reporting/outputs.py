"""Optional outputs are best-effort: the metrics textfile, the ``on_event`` hook, sd_notify, the console.

None of them is the run: each must never stop training, never raise into the loop (where an
``OSError`` would read as the run disk being full) and never flood the log. A failure becomes
``output_failed`` once (the hook's keep ``hook_failed``), is logged again at most every
:data:`RELOG_EVERY_S` with the unlogged count, and ``output_recovered`` once when it works again.
TensorBoard is not here: the trainer writes it on the run's own disk."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.record.eventlog import Listener
from qlora_supervise.supervisor.record.events import Event

METRICS_TEXTFILE = "supervise.metrics_textfile"
ON_EVENT = "supervise.on_event"
SYSTEMD = "systemd notify"
CONSOLE = "console"  # stderr's log lines and progress, stdout's summary (console.ConsoleStream)
#: What a person does about each output's failure; the run goes on either way.
FIXES = {
    METRICS_TEXTFILE: "the run goes on without metrics; free space or make the textfile's directory "
    "writable (or remove supervise.metrics_textfile)",
    ON_EVENT: "the run goes on; fix supervise.on_event (try it with a JSON line on stdin)",
    SYSTEMD: "the run goes on; systemctl status may show an old line until the socket answers again",
    CONSOLE: "the run goes on without console lines (its reader or terminal went away); events.jsonl "
    "has every event and `qlora-supervise status RUN_DIR` the state",
}
#: A failing output is logged again at most this often (with the count of unlogged failures).
RELOG_EVERY_S = 600.0


@dataclass
class _Failing:
    logged_at: float
    failures: int = 1
    unlogged: int = 0


class BestEffort:
    """Runs optional outputs so that none can stop the run. ``log`` is bound once the event log
    exists; a failure before that is not remembered, so the first one after binding is logged."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.log: FilteringBoundLogger | None = None
        self._clock = clock
        self._failing: dict[str, _Failing] = {}

    def run(self, output: str, action: Callable[[], object]) -> bool:
        """``action()``; False when it raised (logged, never raised). ``action`` returning False means
        nothing was due: that neither fails nor recovers the output."""
        try:
            done = action()
        # Blind on purpose: an optional output may fail in any way (OSError from a full or
        # read-only textfile, a ValueError from prometheus_client, a bug in a listener), and
        # none of those may reach the loop.
        except Exception as error:
            self.failed(output, f"{type(error).__name__}: {error}")
            return False
        if done is not False:
            self.worked(output)
        return True

    def listener(self, output: str, listener: Callable[[Mapping[str, object]], object]) -> Listener:

        def guarded(event: Mapping[str, object]) -> None:
            self.run(output, lambda: listener(event))

        return guarded

    def failed(self, output: str, problem: str, event: Event = Event.OUTPUT_FAILED, **fields: object) -> None:
        now = self._clock()
        streak = self._failing.get(output)
        if streak is not None:
            streak.failures += 1
            if now - streak.logged_at < RELOG_EVERY_S:
                streak.unlogged += 1
                return
        if self.log is None:
            return
        unlogged = 0 if streak is None else streak.unlogged
        self._failing[output] = _Failing(now, 1 if streak is None else streak.failures)
        more = {"unlogged_failures": unlogged} if streak is not None else {}
        self.log.warning(event, output=output, problem=problem, fix=FIXES.get(output, ""), **more, **fields)

    def worked(self, output: str) -> None:
        streak = self._failing.pop(output, None)
        if streak is not None and self.log is not None:
            self.log.info(Event.OUTPUT_RECOVERED, output=output, failures=streak.failures)
