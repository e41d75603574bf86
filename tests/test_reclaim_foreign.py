"""Reclaim finds a foreign trainer left running by a dead supervisor by the shim's environment:
an hf-script's command line names nothing of the attempt directory."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from qlora_supervise.supervisor.loop.child import attempt_children
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.trainers.trainer import SHIM_SPEC_ENV
from qlora_supervise.trainer_child.contract.processes import pid_alive

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


def test_a_shimmed_trainer_is_found_by_its_spec_in_the_environment_and_a_stranger_is_not(
    tmp_path: Path,
) -> None:
    """Two sleepers with the same argv: the one the shim was pointed at this spec is the attempt's."""
    rd = RunDir(tmp_path / "run")
    spec = rd.root / "attempt-002" / "spec.json"
    ours = subprocess.Popen(SLEEPER, env={**os.environ, SHIM_SPEC_ENV: str(spec)})
    other_spec = str(rd.root / "attempt-001" / "spec.json")
    stranger = subprocess.Popen(SLEEPER, env={**os.environ, SHIM_SPEC_ENV: other_spec})
    try:
        found = attempt_children(None, spec, rd)
        assert ours.pid in found and stranger.pid not in found
        # A recorded pid that is now a stranger's (reused) is not taken for the attempt's.
        assert stranger.pid not in attempt_children(stranger.pid, spec, rd)
    finally:
        for proc in (ours, stranger):
            proc.kill()
            proc.wait()
    assert attempt_children(ours.pid, spec, rd) == []  # gone: nothing to stop


def test_a_zombie_counts_as_exited() -> None:
    """An exited process its parent has not reaped yet is no live process to wait on."""
    proc = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{proc.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    try:
        assert not pid_alive(proc.pid)
    finally:
        proc.wait()
    assert pid_alive(os.getpid())
