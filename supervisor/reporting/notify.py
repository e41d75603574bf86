"""What systemd hears: the ``sd_notify`` protocol (datagrams to ``$NOTIFY_SOCKET``, a leading ``@``: the
abstract namespace; without it every call is a no-op returning False, so the supervisor calls these
unconditionally) and :class:`ServiceStatus`, which feeds it from progress."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

from tqdm import tqdm

from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.reporting.console import Pace
from qlora_supervise.supervisor.watching.watch import Progress


def notify(**fields: str | int | float | bool) -> bool:
    """Send ``KEY=value`` lines (keys upper-cased; True -> 1). False when not under systemd or on error."""
    where = os.environ.get("NOTIFY_SOCKET", "")  # unset, or a kind we do not speak (vsock:): a no-op
    address = "\0" + where[1:] if where.startswith("@") else where if where.startswith("/") else None
    if address is None or not fields:
        return False
    # True -> 1; a newline in a value would start a new field.
    texts = {key: int(value) if isinstance(value, bool) else value for key, value in fields.items()}
    message = "".join(f"{key.upper()}={value}".replace("\n", " ") + "\n" for key, value in texts.items())
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            # Never wait for systemd: a full receive queue drops this message, not the run.
            sock.setblocking(False)
            sock.connect(address)
            sock.sendall(message.encode("utf-8"))
    except OSError:  # systemd went away, its queue is full, or the socket is not ours: best effort
        return False
    return True


def ready(status_text: str | None = None) -> bool:
    """The service is up (``Type=notify`` waits for this)."""
    return notify(ready=1, **({"status": status_text} if status_text else {}))


def status(text: str) -> bool:
    """One line for ``systemctl status`` (attempt, step, last failure...)."""
    return notify(status=text)


def watchdog() -> bool:
    """Ping the watchdog; call at least every :func:`watchdog_interval_s` / 2 seconds."""
    return notify(watchdog=1)


def stopping(status_text: str | None = None) -> bool:
    """The service is shutting down (checkpointing the child first, perhaps for minutes)."""
    return notify(stopping=1, **({"status": status_text} if status_text else {}))


def extend_timeout(seconds: float) -> bool:
    """Ask systemd for ``seconds`` more before its start/stop timeout fires (systemd 236+)."""
    return notify(extend_timeout_usec=int(seconds * 1_000_000))


def watchdog_interval_s() -> float | None:
    """``WatchdogSec=`` in seconds when the watchdog is on for this process, else None."""
    usec, pid = os.environ.get("WATCHDOG_USEC", ""), os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1_000_000


STATUS_EVERY_S = 5.0
#: While the child saves, ask for this much more time, again every third of it.
SAVE_EXTENSION_S = 90.0


class ServiceStatus:
    """Turns progress into sd_notify messages; cheap to call every tick. ``STATUS=`` when it changes, at
    most every :data:`STATUS_EVERY_S`; ``WATCHDOG=1`` only after a new events line from the child, so
    ``WatchdogSec=`` catches a silent child; ``EXTEND_TIMEOUT_USEC`` while it saves, so that
    ``TimeoutStopSec`` does not cut a checkpoint off."""

    def __init__(self, max_attempts: int, budget_bytes: int | None) -> None:
        self._max_attempts, self._budget, self._watchdog_s = max_attempts, budget_bytes, watchdog_interval_s()
        self._seen_event_at: float | None = None
        self._last_status = ""
        self._status_at = self._ping_at = self._extend_at = -1e18

    def update(self, attempt: int, p: Progress, pace: Pace, now: float) -> None:
        text = status_line(attempt, self._max_attempts, p, pace, self._budget)
        if text != self._last_status and now - self._status_at >= STATUS_EVERY_S:
            status(text)
            self._last_status, self._status_at = text, now
        fresh = p.last_event_at is not None and p.last_event_at != self._seen_event_at
        # A ping per new event would flood systemd at a step a second; a few per interval suffice.
        if fresh and self._watchdog_s is not None and now - self._ping_at >= min(1.0, self._watchdog_s / 4):
            watchdog()
            self._ping_at, self._seen_event_at = now, p.last_event_at
        if p.stage == "save" and now - self._extend_at >= SAVE_EXTENSION_S / 3:
            extend_timeout(SAVE_EXTENSION_S)
            self._extend_at = now

    def on_event(self, event: Mapping[str, object]) -> bool:
        """A stop request: tell systemd it is stopping and how long the checkpoint may take (else False)."""
        if event.get("event") != Event.STOP_REQUESTED.value:
            return False
        grace = float(given) if isinstance(given := event.get("grace_s"), int | float) else 0.0
        stopping(f"stopping: the trainer checkpoints first (up to {tqdm.format_interval(grace)})")
        extend_timeout(grace + SAVE_EXTENSION_S)
        return True


def status_line(attempt: int, max_attempts: int, p: Progress, pace: Pace, budget: int | None) -> str:
    """The one line ``systemctl status`` shows."""
    parts = [f"attempt {attempt}/{max_attempts}", f"step {p.step}/{p.max_steps or '?'}"]
    if p.stage not in ("forward", "backward", "optimizer"):
        parts.append(p.stage)  # load, save, eval, merge: worth saying; the training stages are not
    if (rate := p.tokens_per_s) is not None:
        parts.append(f"{rate / 1000:.1f}k tok/s" if rate >= 1000 else f"{rate:.0f} tok/s")
    if p.peak_bytes and budget is None:
        parts.append(f"peak {format_bytes(p.peak_bytes)}")
    elif p.peak_bytes and budget is not None:
        unit, scale = ("GiB", 2**30) if budget >= 2**30 else ("MiB", 2**20)
        parts.append(f"peak {p.peak_bytes / scale:.1f}/{budget / scale:.0f} {unit}")
    if pace.eta_s is not None:
        parts.append(f"ETA {tqdm.format_interval(pace.eta_s)}")
    return " · ".join(parts)
