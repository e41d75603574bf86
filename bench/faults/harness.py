"""The fault bench's harness: a job in a temp dir, the supervisor process, what scenarios watch.

See ``suite.py`` for the scenarios and the measures.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCRIPTED = ROOT / "tests" / "run_scripted.py"
STEPS = 12
REAL_STEPS = 6  # the real trainer on two CPU cores: a few seconds a step
SAVE_STEPS = 2
MIB = 1 << 20


@dataclass
class Run:
    """One supervised job under one scenario, and what the bench measured."""

    scenario: str
    seed: int
    real: bool = False
    exits: list[int] = field(default_factory=list)
    kills: int = 0
    finished: bool = False
    lost_inherent: int = 0
    lost_avoidable: int = 0
    corrupt: list[str] = field(default_factory=list)
    tracebacks: int = 0
    outside: int = 0  # files or directories that appeared outside the run directory (see below)
    misses: list[str] = field(default_factory=list)  # a scenario's own check that failed
    wall_s: float = 0.0
    note: str = ""


class Harness:
    """A job in a temp dir, the supervisor process, and the helpers a scenario uses."""

    def __init__(self, work: Path, rng: random.Random, real: bool, tiny: Path | None) -> None:
        self.work, self.rng, self.real = work, rng, real
        self.run_dir = work / "run"
        self.job = work / "job.yaml"
        self.env = {**os.environ, "SCRIPTED_CHILD_STEP_S": "0.08", "SCRIPTED_STOP_GRACE_S": "2"}
        self.stderr: list[str] = []
        self.proc: subprocess.Popen[str] | None = None
        self.damaged: list[str] = []
        self.mount: Path | None = None
        #: Paths outside the run directory that the run may write (a configured metrics textfile's
        #: folder, the peak store); everything else new under ``work`` is a write outside the run.
        self.allowed_outside: list[Path] = []
        self.strays: list[int] = []  # processes a scenario stopped that close() must not leave behind
        self._write_job(tiny)
        self._outside_before = self.outside_entries()

    def _write_job(self, tiny: Path | None) -> None:
        plan = self.work / "plan.json"
        plan.write_text(json.dumps({"default": "ok"}))
        self.env["SCRIPTED_CHILD_PLAN"] = str(plan)
        if tiny is not None:
            raw = yaml.safe_load((tiny / "job.yaml").read_text())
            raw["model"]["path"] = str(tiny / "model")
            raw["data"]["path"] = str(tiny / "data.jsonl")
            raw["train"].update(
                max_steps=REAL_STEPS,
                save_steps=SAVE_STEPS,
                logging_steps=1,
                effective_batch_size=2,
                max_seq_len=128,
            )
            raw["resources"] = {"gpu": "cpu"}
        else:
            model = self.work / "model"
            model.mkdir()
            (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
            (self.work / "data.jsonl").write_text(
                "".join(json.dumps({"text": f"r{i}"}) + "\n" for i in range(20))
            )
            raw = {
                "model": {"path": "model"},
                "data": {"path": "data.jsonl"},
                "train": {
                    "micro_batch_size": 4,
                    "effective_batch_size": 8,
                    "max_steps": STEPS,
                    "save_steps": SAVE_STEPS,
                    "max_seq_len": 256,
                },
                "resources": {"gpu": "cpu"},
            }
        raw["supervise"] = {
            "hang_timeout": "2s" if tiny is None else "5m",
            "backoff_initial": "0.05s",
            "backoff_max": "0.2s",
            "disk_wait": "60s",
            "max_attempts": 12,
        }
        raw["output_dir"] = str(self.run_dir)
        self.job.write_text(yaml.safe_dump(raw))

    def edit_job(self, **train: Any) -> None:
        raw = yaml.safe_load(self.job.read_text())
        raw["train"].update(train)
        self.job.write_text(yaml.safe_dump(raw))

    def edit_supervise(self, **supervise: Any) -> None:
        raw = yaml.safe_load(self.job.read_text())
        raw["supervise"].update(supervise)
        for key in [k for k, v in supervise.items() if v is None]:
            del raw["supervise"][key]
        self.job.write_text(yaml.safe_dump(raw))

    def outside_entries(self) -> set[str]:
        """Every path under ``work`` outside the run directory (and outside the allowed ones)."""
        found = set()
        for path in self.work.rglob("*"):
            inside = [self.run_dir, *self.allowed_outside, *([self.mount] if self.mount else [])]
            if any(path == top or top in path.parents for top in inside):
                continue
            found.add(str(path.relative_to(self.work)))
        return found

    def rebase_outside(self) -> None:
        """What a scenario planted before the start is not the run's writing."""
        self._outside_before = self.outside_entries()

    def ready_spare(self) -> int | None:
        """The pid of the newest spare that reported ready and is alive (None: none)."""
        log = self.run_dir / "spare.log"
        pids = []
        with contextlib.suppress(OSError):
            for line in log.read_text(encoding="utf-8", errors="replace").splitlines():
                with contextlib.suppress(ValueError):
                    event = json.loads(line)
                    if isinstance(event, dict) and event.get("event") == "spare_ready":
                        pids.append(int(event["pid"]))
        return pids[-1] if pids and _alive(pids[-1]) else None

    def newest_attempt(self) -> int:
        numbers = [int(p.name[8:]) for p in self.run_dir.glob("attempt-*") if p.name[8:].isdigit()]
        return max(numbers, default=0)

    def written_outside(self) -> list[str]:
        """What appeared outside the run directory since the harness was made."""
        return sorted(self.outside_entries() - self._outside_before)

    def newest_step(self) -> int:
        """The newest heartbeat step of the newest attempt (0: none yet)."""
        attempts = sorted(p for p in self.run_dir.glob("attempt-*") if p.name[8:].isdigit())
        if not attempts:
            return 0
        with contextlib.suppress(OSError):
            lines = (attempts[-1] / "child-events.jsonl").read_text().splitlines()
            return max(
                (json.loads(line).get("step") or 0 for line in lines if '"heartbeat"' in line), default=0
            )
        return 0

    def on_small_disk(self) -> bool:
        """Put the run directory on a fresh 8 MiB tmpfs (root only)."""
        mount = self.work / "disk"
        mount.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True
        )
        if done.returncode != 0:
            return False
        self.mount = mount
        self.run_dir = mount / "run"
        raw = yaml.safe_load(self.job.read_text())
        raw["output_dir"] = str(self.run_dir)
        self.job.write_text(yaml.safe_dump(raw))
        return True

    def close(self) -> None:
        for pid in self.strays:
            self.kill(pid)
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.mount is not None:
            subprocess.run(["umount", "-l", str(self.mount)], check=False)

    # -- the supervisor -------------------------------------------------------------------

    def command(self) -> list[str]:
        if self.real:
            return [
                sys.executable,
                "-m",
                "qlora_supervise.supervisor.commands.cli",
                "run",
                "--plain",
                str(self.job),
            ]
        return [sys.executable, str(SCRIPTED), str(self.job)]

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.command(), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=self.env
        )

    def wait_exit(self, timeout: float = 600.0) -> int:
        assert self.proc is not None
        try:
            _, err = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            _, err = self.proc.communicate()
        self.stderr.append(err or "")
        return int(self.proc.returncode)

    def to_the_end(self, run: Run, first_exit: int | None = None) -> None:
        """Wait for the supervisor; whenever a fault ended it, run the same command again."""
        code = first_exit if first_exit is not None else self.wait_exit()
        run.exits.append(code)
        for _ in range(6):
            if code not in (143, 130, -9, 137):
                break
            self.start()
            code = self.wait_exit()
            run.exits.append(code)

    # -- what a scenario watches ----------------------------------------------------------

    def until(self, predicate: Callable[[], bool], timeout: float = 60.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, ValueError):
                if predicate():
                    return True
            time.sleep(0.02)
        return False

    def child_pid(self) -> int | None:
        state = json.loads((self.run_dir / "state.json").read_text())
        flight = state.get("in_flight") or {}
        pid = flight.get("pid")
        return int(pid) if pid else None

    def child_running(self) -> bool:
        """The attempt in flight has a live child that trained at least one step of its own."""
        pid = self.child_pid()
        return pid is not None and _alive(pid) and self.trained_steps() > 0

    def trained_steps(self) -> int:
        """Steps the newest attempt trained past the step it resumed from."""
        attempts = sorted(p for p in self.run_dir.glob("attempt-*") if p.name[8:].isdigit())
        if not attempts:
            return 0
        spec = json.loads((attempts[-1] / "spec.json").read_text())
        start = _marker_step(spec.get("resume_from"))
        steps = [
            json.loads(line).get("step") or 0
            for line in (attempts[-1] / "child-events.jsonl").read_text().splitlines()
            if '"heartbeat"' in line
        ]
        return max(steps, default=0) - start

    def saving(self) -> bool:
        return any((self.run_dir / "checkpoints").glob(".tmp-checkpoint-*"))

    def after_random_progress(self) -> bool:
        """Wait for a running child, then a random 0.1-0.8 s (1 to 10 steps of the scripted child)."""
        if not self.until(self.child_running):
            return False
        time.sleep(self.rng.uniform(0.1, 0.8) * (6 if self.real else 1))
        return True

    def kill(self, pid: int | None, sig: int = signal.SIGKILL) -> bool:
        if pid is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
            return True
        return False


def _marker_step(checkpoint: str | None) -> int:
    if not checkpoint:
        return 0
    return int(json.loads((Path(checkpoint) / "qlora_supervise_complete.json").read_text())["step"])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def fill_disk(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    try:
        chunk = MIB
        while chunk:
            try:
                os.write(fd, b"\0" * chunk)
            except OSError:
                chunk //= 2
    finally:
        os.close(fd)


def newest_complete(run_dir: Path) -> Path | None:
    found = [
        p
        for p in (run_dir / "checkpoints").glob("checkpoint-*")
        if (p / "qlora_supervise_complete.json").is_file()
    ]
    return max(found, key=lambda p: int(p.name.rsplit("-", 1)[-1]), default=None)
