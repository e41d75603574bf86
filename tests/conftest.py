"""Shared fixtures. The trainer-child fixtures live in ``_child.py``; registered here so the
session-scoped tiny model is built once for all test modules."""

import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from _child import tiny_dir_fixture  # noqa: F401 - registers the `tiny_dir` fixture


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow tests first (their order among themselves and the others' kept): under ``-n 2`` the
    workers start on the long real-process tests and finish on the short ones, so neither waits
    alone on a long one at the end. The sort is stable: the modules with module-scoped fixtures
    (all slow) stay together, so each fixture runs once."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(autouse=True)
def _peak_store_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test keeps the per-host peak store in a temp dir: tests never write to ~/.local/state."""
    monkeypatch.setenv("QLORA_SUPERVISE_STATE_DIR", str(tmp_path_factory.mktemp("state")))


@pytest.fixture(autouse=True)
def _scripted_plan_per_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scripted child's plan (``SCRIPTED_CHILD_PLAN``, which the loop tests' ``_job`` points at
    their own tmp file) is undone after every test, so no test inherits another's plan."""
    monkeypatch.delenv("SCRIPTED_CHILD_PLAN", raising=False)


@pytest.fixture
def notify_socket(monkeypatch: pytest.MonkeyPatch) -> Iterator[socket.socket]:
    """A datagram socket bound to a short path, named by NOTIFY_SOCKET (as systemd does)."""
    directory = Path(tempfile.mkdtemp(prefix="sdn", dir="/tmp"))  # sun_path is limited to 108 bytes
    path = directory / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    monkeypatch.setenv("NOTIFY_SOCKET", str(path))
    try:
        yield sock
    finally:
        sock.close()
        path.unlink(missing_ok=True)
        directory.rmdir()
