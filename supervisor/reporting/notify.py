"""systemd's ``sd_notify`` protocol, standard library only: READY, STATUS, WATCHDOG, STOPPING.

Datagrams to ``$NOTIFY_SOCKET`` (a leading ``@``: the abstract namespace); without it every call is a
no-op returning False, so the supervisor calls these unconditionally. The unit's
``NotifyAccess=main`` counts only the supervisor's messages, never the child's."""

from __future__ import annotations

import os
import socket

NOTIFY_SOCKET = "NOTIFY_SOCKET"


def notify(**fields: str | int | float | bool) -> bool:
    """Send ``KEY=value`` lines (keys upper-cased; True -> 1). False when not under systemd or on error."""
    address = _address()
    if address is None or not fields:
        return False
    message = "".join(f"{key.upper()}={_value(value)}\n" for key, value in fields.items())
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
    usec = os.environ.get("WATCHDOG_USEC", "")
    pid = os.environ.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0 or (pid and pid != str(os.getpid())):
        return None
    return int(usec) / 1_000_000


def _address() -> str | None:
    value = os.environ.get(NOTIFY_SOCKET, "")
    if value.startswith("@"):
        return "\0" + value[1:]  # abstract namespace
    if value.startswith("/"):
        return value
    return None  # unset, or a kind we do not speak (vsock:)


def _value(value: str | int | float | bool) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value).replace("\n", " ")  # a newline would start a new field
