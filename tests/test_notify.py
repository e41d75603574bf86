"""sd_notify against a real AF_UNIX datagram socket."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest

from qlora_supervise.supervisor.reporting import notify


@pytest.fixture
def listener(notify_socket: socket.socket) -> socket.socket:
    """The NOTIFY_SOCKET listener of conftest, under this module's name for it."""
    return notify_socket


def _received(sock: socket.socket) -> str:
    return sock.recv(4096).decode()


def test_without_notify_socket_everything_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Outside systemd the helpers return False and do nothing."""
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert not notify.ready() and not notify.status("x") and not notify.watchdog() and not notify.stopping()


def test_ready_with_status(listener: socket.socket) -> None:
    """ready() sends READY=1, with a STATUS line when given."""
    assert notify.ready("loaded job")
    assert _received(listener) == "READY=1\nSTATUS=loaded job\n"


@pytest.mark.parametrize(
    ("send", "expected"),
    [
        (lambda: notify.status("attempt 2\nstep 40"), "STATUS=attempt 2 step 40\n"),  # one line only
        (notify.watchdog, "WATCHDOG=1\n"),
        (notify.stopping, "STOPPING=1\n"),
        (lambda: notify.extend_timeout(90), "EXTEND_TIMEOUT_USEC=90000000\n"),
        (lambda: notify.notify(errno=12, buserror=True), "ERRNO=12\nBUSERROR=1\n"),
    ],
)
def test_messages(listener: socket.socket, send: Callable[[], bool], expected: str) -> None:
    """Each helper sends its KEY=value lines as one datagram."""
    assert send()
    assert _received(listener) == expected


def test_abstract_namespace_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    """A NOTIFY_SOCKET starting with @ names a socket in the abstract namespace."""
    name = f"qlora-supervise-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind("\0" + name)
        sock.settimeout(5)
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        assert notify.status("abstract")
        assert _received(sock) == "STATUS=abstract\n"


def test_dead_socket_returns_false(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A socket path nobody listens on (systemd restarted) gives False, not an exception."""
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))
    assert notify.ready() is False


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        ("30000000", None, 30.0),
        ("30000000", "self", 30.0),
        ("30000000", "1", None),
        ("0", None, None),
        (None, None, None),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    """WATCHDOG_USEC gives the interval in seconds, only when WATCHDOG_PID (if set) is this process."""
    for name, value in (
        ("WATCHDOG_USEC", usec),
        ("WATCHDOG_PID", str(os.getpid()) if pid == "self" else pid),
    ):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert notify.watchdog_interval_s() == expected
