"""What systemd hears while an attempt runs: STATUS, WATCHDOG fed by progress, EXTEND_TIMEOUT_USEC.

``STATUS=`` when it changes, at most every :data:`STATUS_EVERY_S`; ``WATCHDOG=1`` only after a sign of
life from the child (a new events line), so ``WatchdogSec=`` catches a silent child, not a ticking
timer; ``EXTEND_TIMEOUT_USEC`` while it saves, so ``TimeoutStopSec`` does not cut a checkpoint off."""

from __future__ import annotations

from collections.abc import Mapping

from tqdm import tqdm

from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.reporting import notify
from qlora_supervise.supervisor.reporting.pace import Pace
from qlora_supervise.supervisor.watching.heartbeats import Progress

STATUS_EVERY_S = 5.0
#: While the child saves, ask for this much more time, again every third of it.
SAVE_EXTENSION_S = 90.0


class ServiceStatus:
    """Turns progress into sd_notify messages; cheap to call every tick."""

    def __init__(self, max_attempts: int, budget_bytes: int | None) -> None:
        self._max_attempts = max_attempts
        self._budget = budget_bytes
        self._watchdog_s = notify.watchdog_interval_s()
        self._last_status = ""
        self._status_at = -1e18
        self._seen_event_at: float | None = None
        self._ping_at = -1e18
        self._extend_at = -1e18

    def update(self, attempt: int, p: Progress, pace: Pace, now: float) -> None:
        text = status_line(attempt, self._max_attempts, p, pace, self._budget)
        if text != self._last_status and now - self._status_at >= STATUS_EVERY_S:
            notify.status(text)
            self._last_status, self._status_at = text, now
        fresh = p.last_event_at is not None and p.last_event_at != self._seen_event_at
        # A ping per new event would flood systemd at a step a second; a few per interval suffice.
        if fresh and self._watchdog_s is not None and now - self._ping_at >= min(1.0, self._watchdog_s / 4):
            notify.watchdog()
            self._ping_at, self._seen_event_at = now, p.last_event_at
        if p.stage == "save" and now - self._extend_at >= SAVE_EXTENSION_S / 3:
            notify.extend_timeout(SAVE_EXTENSION_S)
            self._extend_at = now

    def on_event(self, event: Mapping[str, object]) -> bool:
        """A stop request: tell systemd it is stopping and how long the checkpoint may take (else False)."""
        if event.get("event") != Event.STOP_REQUESTED.value:
            return False
        given = event.get("grace_s")
        grace = float(given) if isinstance(given, int | float) else 0.0
        notify.stopping(f"stopping: the trainer checkpoints first (up to {tqdm.format_interval(grace)})")
        notify.extend_timeout(grace + SAVE_EXTENSION_S)
        return True


def status_line(attempt: int, max_attempts: int, p: Progress, pace: Pace, budget: int | None) -> str:
    """The one line ``systemctl status`` shows."""
    parts = [f"attempt {attempt}/{max_attempts}", f"step {p.step}/{p.max_steps or '?'}"]
    if p.stage not in ("forward", "backward", "optimizer"):
        parts.append(p.stage)  # load, save, eval, merge: worth saying; the training stages are not
    if p.tokens_per_s is not None:
        parts.append(f"{_short(p.tokens_per_s)} tok/s")
    if p.peak_bytes:
        parts.append(f"peak {_peak(p.peak_bytes, budget)}")
    if pace.eta_s is not None:
        parts.append(f"ETA {tqdm.format_interval(pace.eta_s)}")
    return " · ".join(parts)


def _short(rate: float) -> str:
    return f"{rate / 1000:.1f}k" if rate >= 1000 else f"{rate:.0f}"


def _peak(peak: int, budget: int | None) -> str:
    if budget is None:
        return format_bytes(peak)
    unit, scale = ("GiB", 2**30) if budget >= 2**30 else ("MiB", 2**20)
    return f"{peak / scale:.1f}/{budget / scale:.0f} {unit}"
