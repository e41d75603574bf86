"""`run` under a fake systemd: a datagram NOTIFY_SOCKET, the watchdog on, the scripted child."""

from __future__ import annotations

import io
import json
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.reporting import notify

sys.path.insert(0, str(Path(__file__).parent))
from run_scripted import scripted_seams


@pytest.fixture
def systemd_socket(notify_socket: socket.socket, monkeypatch: pytest.MonkeyPatch) -> socket.socket:
    """The NOTIFY_SOCKET listener of conftest, with WATCHDOG_USEC set, as systemd would."""
    notify_socket.settimeout(0.05)
    monkeypatch.setenv("WATCHDOG_USEC", "2000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    return notify_socket


class Listener(threading.Thread):
    """Reads the socket as systemd does, all the time (the kernel queues only a few datagrams)."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(daemon=True)
        self.sock = sock
        self.messages: list[str] = []
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.is_set():
            try:
                self.messages.append(self.sock.recv(65536).decode())
            except TimeoutError:
                continue


def _job(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plan: dict[str, str], **extra: object) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(20)))
    job = {
        "model": {"path": "model"},
        "data": {"path": "data.jsonl"},
        "train": {"micro_batch_size": 4, "effective_batch_size": 8, "max_steps": 10, "save_steps": 4},
        "resources": {"gpu": "cpu", "cpu_memory_limit": "2GiB"},
        "supervise": {"hang_timeout": "5s", "backoff_initial": "0.05s", "backoff_max": "0.2s", **extra},
        "output_dir": "run",
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    monkeypatch.setenv("SCRIPTED_CHILD_PLAN", str(tmp_path / "plan.json"))
    return path


def test_run_tells_systemd_ready_status_watchdog_and_stopping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, systemd_socket: socket.socket
) -> None:
    """READY first, STATUS lines with attempt, step, ETA and peak, WATCHDOG pings, STOPPING last."""
    monkeypatch.setattr(notify, "STATUS_EVERY_S", 0.2)  # systemd's rate limit, shortened for a 2 s run
    monkeypatch.setenv("SCRIPTED_CHILD_STEP_S", "0.1")  # a few STATUS lines per attempt, not one
    job = _job(tmp_path, monkeypatch, {"1": "oom_forward@3", "default": "ok"})
    listener = Listener(systemd_socket)
    listener.start()
    code = run_job(str(job), plain=True, seams=scripted_seams(), console=io.StringIO(), install_signals=False)
    time.sleep(0.2)
    listener.done.set()
    listener.join()
    assert code == 0
    messages = listener.messages
    assert messages[0].startswith("READY=1\n")
    statuses = [m for m in messages if m.startswith("STATUS=")]
    stepping = [s for s in statuses if "step " in s and "ETA " in s and "peak " in s]
    assert stepping, statuses
    assert any(s.startswith("STATUS=attempt 2/8 · step ") for s in stepping), stepping
    assert any(m == "WATCHDOG=1\n" for m in messages)
    assert messages[-1].startswith("STOPPING=1\n")


def test_status_of_a_config_error_names_the_fix_and_the_child_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A wrong target_modules: status prints the child's message as the fix and points to child.log."""
    from qlora_supervise.supervisor.commands.status import status_command

    job = _job(tmp_path, monkeypatch, {"1": "config_error"})
    code = run_job(str(job), plain=True, seams=scripted_seams(), console=io.StringIO(), install_signals=False)
    assert code == 4
    capsys.readouterr()
    assert status_command([str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert "  fix: " in out and "target_modules ['q'] matched no layer" in out
    assert f"  log: {tmp_path / 'run' / 'attempt-001' / 'child.log'}" in out
