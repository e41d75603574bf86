"""The warm spare: a trainer child that has imported the stack and waits for the next attempt.

The keeper's rules are checked with a stand-in process; the spare itself, and a supervised run
whose second attempt runs in it, use real processes on the tiny model.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest
from _child import capped_job

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.loop import child as child_mod
from qlora_supervise.supervisor.loop.child import _is_attempt_child
from qlora_supervise.supervisor.loop.spare import (
    RAM_HEADROOM,
    SpareKeeper,
    SpareOrder,
    ready_line,
    room_for_spare,
    runs_in_spare,
    spare_enabled,
)
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.supervisor.record.rundir import RunDir


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def _add(self, event: object, **fields: Any) -> None:
        self.lines.append((str(event), fields))

    info = warning = error = _add

    def names(self) -> list[str]:
        return [name for name, _ in self.lines]


class _StandIn:
    """A spare that is no process: records what the keeper sends and whether it was stopped; it
    acknowledges a handed spec on its log as the real spare does (``spare_ack``)."""

    def __init__(self, pid: int, log_path: Path | None = None) -> None:
        self.pid = pid
        self.log_path = log_path
        self.started_monotonic = 0.0
        self.sent: list[str] = []
        self.stopped = False

    def poll(self) -> int | None:
        return 0 if self.stopped else None

    def send_line(self, line: str) -> bool:
        self.sent.append(line)
        if line.strip() and self.log_path is not None:
            with self.log_path.open("a") as log:
                log.write(json.dumps({"event": "spare_ack", "pid": self.pid}) + "\n")
        return True

    def wait_for_exit(self, timeout_s: float, sleep: Callable[[float], None]) -> None:
        sleep(timeout_s)

    def stop(self, grace_s: float) -> int:
        self.stopped = True
        return 0


def _keeper(tmp_path: Path, log: _Log) -> tuple[SpareKeeper, list[_StandIn]]:
    started: list[_StandIn] = []

    def spawn(argv: list[str], env: Mapping[str, str], log_path: Path, cwd: Path) -> _StandIn:
        started.append(_StandIn(1000 + len(started), log_path))
        return started[-1]

    return SpareKeeper(tmp_path, spawn, time.monotonic, lambda s: None, log), started


def _order(expandable: bool, model: str = "/m") -> SpareOrder:
    env = child_mod.child_env({"PATH": "/usr/bin"}, _knobs(expandable))
    return SpareOrder(env, "cpu", expandable, model)


def _knobs(expandable: bool) -> Any:
    from qlora_supervise.trainer_child.contract.spec import Knobs

    return Knobs(model="/m", expandable_segments=expandable)


def test_a_spare_is_handed_the_attempt_it_was_started_for(tmp_path: Path) -> None:
    """A spare whose environment matches gets the spec and log paths on its stdin, its clock restarted."""
    log = _Log()
    keeper, started = _keeper(tmp_path, log)
    keeper.ensure(_order(True))
    proc = keeper.take(_order(True, model="/other"), tmp_path / "spec.json", tmp_path / "child.log")
    assert proc is started[0] and proc.started_monotonic > 0
    order = json.loads(started[0].sent[0])
    assert order == {"spec": str(tmp_path / "spec.json"), "log": str(tmp_path / "child.log")}
    assert log.names() == ["spare_started", "spare_used"]
    assert keeper.spare is None


def test_a_spare_started_before_the_allocator_changed_is_discarded(tmp_path: Path) -> None:
    """expandable_segments changed: the spare is stopped, not used, and the log names the variable."""
    log = _Log()
    keeper, started = _keeper(tmp_path, log)
    keeper.ensure(_order(False))
    assert keeper.take(_order(True), tmp_path / "spec.json", tmp_path / "child.log") is None
    assert started[0].stopped and started[0].sent == []
    name, fields = log.lines[-1]
    assert name == "spare_discarded" and "PYTORCH_ALLOC_CONF" in fields["why"]
    keeper.ensure(_order(True))  # the next one is started with the new environment
    assert len(started) == 2 and keeper.spare is not None and keeper.spare.order == _order(True)


def test_a_spare_that_does_not_acknowledge_the_spec_is_discarded(tmp_path: Path) -> None:
    """A ready spare that writes no spare_ack within seconds is stopped and the attempt starts cold."""
    log = _Log()
    started: list[_StandIn] = []
    now = [0.0]

    def spawn(argv: list[str], env: Mapping[str, str], log_path: Path, cwd: Path) -> _StandIn:
        started.append(_StandIn(1000 + len(started)))  # no log path: it never acknowledges
        return started[-1]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    keeper = SpareKeeper(tmp_path, spawn, lambda: now[0], sleep, log)
    keeper.ensure(_order(True))
    (tmp_path / "spare.log").write_text(json.dumps({"event": "spare_ready", "pid": 1000}) + "\n")
    assert keeper.take(_order(True), tmp_path / "spec.json", tmp_path / "child.log") is None
    assert started[0].stopped and len(started[0].sent) == 1
    name, fields = log.lines[-1]
    assert name == "spare_discarded" and "no acknowledgement" in fields["why"]
    assert 4.9 <= now[0] <= 6.0  # seconds, not the hang timeout


def test_spare_rules_cpus_setting_and_ram() -> None:
    """auto needs 4 CPUs, false is off, true keeps one on 2 CPUs; RAM short means none."""
    assert spare_enabled("auto", cpus=2)[0] is False
    assert spare_enabled("auto", cpus=8)[0] is True
    assert spare_enabled(True, cpus=2)[0] is True
    assert spare_enabled(False, cpus=64) == (False, "supervise.warm_spare is false")
    assert room_for_spare(1 << 30, available=(1 << 30) + RAM_HEADROOM)
    assert not room_for_spare(1 << 30, available=(1 << 30) + RAM_HEADROOM - 1)


def test_only_one_plain_training_process_runs_in_a_spare(tmp_path: Path) -> None:
    """torchrun's ranks, a merge and a scripted child never run in a spare; the spare refuses a
    several-process spec even if handed one."""
    from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DataSpec, TrainSpec
    from qlora_supervise.trainer_child.run.spare import check_spec

    trainer = child_mod.child_argv(tmp_path / "spec.json", "train")
    assert runs_in_spare(trainer, trainer, train=True, world_size=1)
    assert not runs_in_spare(trainer, trainer, train=True, world_size=2)
    assert not runs_in_spare(trainer, trainer, train=False, world_size=1)
    assert not runs_in_spare(["python", "scripted_child.py"], trainer, train=True, world_size=1)
    knobs = dataclasses.replace(_knobs(True), world_size=2)
    spec = AttemptSpec(1, str(tmp_path), knobs, DataSpec("d.jsonl"), TrainSpec(), "e", "f", "c", "a", "m")
    assert "several processes" in (check_spec(spec, "auto", True) or "")
    single = dataclasses.replace(spec, knobs=_knobs(True))
    assert check_spec(single, "auto", True) is None
    assert "expandable_segments" in (check_spec(single, "auto", False) or "")


def test_reclaim_knows_a_spare_of_this_run_by_its_command_line(tmp_path: Path) -> None:
    """A spare names its run directory; one of another run (a prefix of this one's name) is not ours."""
    rd = RunDir(tmp_path / "run")
    spec = rd.attempt_dir(2) / "spec.json"
    ours = f"python -m qlora_supervise.trainer_child.run.spare --run-dir {rd.root} --device cpu"
    theirs = f"python -m qlora_supervise.trainer_child.run.spare --run-dir {rd.root}2 --device cpu"
    assert _is_attempt_child(ours, spec, rd)
    assert not _is_attempt_child(theirs, spec, rd)
    assert _is_attempt_child(f"python -m qlora_supervise.trainer_child --spec {spec}", spec, rd)


@pytest.mark.slow
def test_the_spare_imports_the_stack_without_cuda_and_leaves_on_eof(tmp_path: Path) -> None:
    """The spare reports ready with torch imported and CUDA untouched, and an empty stdin ends it at once."""
    order = SpareOrder(child_mod.child_env(dict(os.environ), _knobs(True)), "cpu", True, "/none")
    argv = [sys.executable, "-m", "qlora_supervise.trainer_child.run.spare", "--run-dir", str(tmp_path)]
    # A spec to prepare from that cannot be read: the spare says so and serves all the same.
    argv += ["--prepare", str(tmp_path / "missing" / "spec.json")]
    proc = child_mod.spawn_spare([*argv, "--device", "cpu"], order.env, tmp_path / "spare.log", tmp_path)
    deadline = time.monotonic() + 120
    while (ready := ready_line(tmp_path / "spare.log", proc.pid)) is None and time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "spare.log").read_text()
        time.sleep(0.2)
    assert ready is not None
    assert ready["cuda_initialized"] is False and ready["import_s"] > 0 and ready["rss"] > 100 << 20
    assert "FileNotFoundError" in ready["prepare_error"] and "prepare_s" not in ready
    modules = subprocess.run(["cat", f"/proc/{proc.pid}/maps"], capture_output=True, text=True).stdout
    assert "libtorch" in modules  # the stack is loaded in the waiting process
    assert proc.send_line("")
    assert proc.popen.wait(timeout=20) == 0


def _losses(run: Path, attempt: int) -> dict[int, float]:
    lines = (run / f"attempt-{attempt:03d}" / "child-events.jsonl").read_text().splitlines()
    beats = [json.loads(line) for line in lines]
    return {b["step"]: b["loss"] for b in beats if b["event"] == "heartbeat" and b.get("loss") is not None}


def _child_event(run: Path, attempt: int, name: str) -> dict[str, Any]:
    lines = (run / f"attempt-{attempt:03d}" / "child-events.jsonl").read_text().splitlines()
    return next(e for e in map(json.loads, lines) if e["event"] == name)


@pytest.mark.slow
def test_a_real_oom_recovers_in_the_spare_with_the_same_result(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a real CPU OOM at step 2 the next attempt runs in the spare, with a cold restart.s losses."""
    # Injected timing, real failure: the cap is applied after step 1, so the OOM comes mid-run.
    monkeypatch.setenv("QLORA_SUPERVISE_TEST_CAP_AFTER_STEP", "1")
    runs = {}
    for warm in (True, False):
        job = capped_job(
            tiny_dir, tmp_path / f"warm-{warm}", max_steps=4, save_steps=2, supervise={"warm_spare": warm}
        )
        assert run_job(str(job), plain=True, console=io.StringIO(), install_signals=False) == 0
        runs[warm] = tmp_path / f"warm-{warm}" / "run"
    events = read_events(runs[True] / "events.jsonl")
    used = [e for e in events if e["event"] == "spare_used"]
    assert len(used) == 1 and used[0]["ready"] is True and used[0]["cuda_initialized"] is False
    started = [e for e in events if e["event"] == "attempt_started"]
    assert started[1]["pid"] == used[0]["pid"]  # attempt 2 is the spare's process
    first = [e for e in events if e["event"] == "first_step"]
    assert [e["warm_spare"] for e in first] == [False, True]
    assert "since_failure_s" not in first[0] and first[1]["since_failure_s"] > 0
    records, _ = read_attempts(runs[True] / "attempts.jsonl")
    assert [r.outcome for r in records] == ["failed", "succeeded"] and records[1].steps_completed == 4
    assert "spare_discarded" in [e["event"] for e in events][-4:]  # the run's end stops the last spare
    cold = read_events(runs[False] / "events.jsonl")
    assert not [e for e in cold if e["event"] == "spare_used"]
    assert _losses(runs[True], 2) == _losses(runs[False], 2) and len(_losses(runs[True], 2)) >= 3
    # The spare had loaded attempt 2's tokenizer and rows ahead, from attempt 1's spec; the
    # cold attempt loaded its own, and both saw the same rows.
    ready = {warm: _child_event(runs[warm], 2, "trainer_ready") for warm in runs}
    assert ready[True]["prepared"] is True and ready[False]["prepared"] is False
    assert set(ready[True]["phases_s"]) == {"tokenizer", "weights", "lora", "data", "trainer"}
    loaded = {warm: _child_event(runs[warm], 2, "loaded") for warm in runs}
    assert loaded[True]["sample_lengths"] == loaded[False]["sample_lengths"]
    assert loaded[True]["train_rows"] == loaded[False]["train_rows"] > 0


def test_the_watch_wakes_at_the_childs_exit_not_at_the_next_tick(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """wait_for_exit returns at the exit (well before its timeout), returns at the timeout while
    the child lives, leaves no descriptor open, and without pidfds sleeps the tick out."""
    gc.collect()  # a file an earlier test in this worker left to the collector is closed now, not mid-test
    fds = len(os.listdir("/proc/self/fd"))
    quick = child_mod.spawn_child(
        [sys.executable, "-c", "import time; time.sleep(0.3)"], dict(os.environ), tmp_path / "q.log", tmp_path
    )
    began = time.monotonic()
    quick.wait_for_exit(30.0)
    assert time.monotonic() - began < 10.0 and quick.poll() == 0
    slow = child_mod.spawn_child(
        [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), tmp_path / "s.log", tmp_path
    )
    began = time.monotonic()
    slow.wait_for_exit(0.3)
    assert 0.25 <= time.monotonic() - began < 5.0 and slow.poll() is None
    slept: list[float] = []

    def no_pidfds(pid: int, flags: int = 0) -> int:  # ENODEV: psutil's wait_procs falls back too
        raise OSError(errno.ENODEV, "no pidfd here")

    monkeypatch.setattr(os, "pidfd_open", no_pidfds)
    slow.wait_for_exit(0.7, slept.append)
    assert slept == [0.7]
    slow.stop(1.0)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) == fds


def _ready_real_spare(tmp_path: Path) -> tuple[SpareKeeper, _Log]:
    """A keeper with a real spare started and waited for until it reported ready (or 120 s)."""
    log = _Log()
    keeper = SpareKeeper(tmp_path, child_mod.spawn_spare, time.monotonic, time.sleep, log)
    keeper.ensure(SpareOrder(child_mod.child_env(dict(os.environ), _knobs(True)), "cpu", True, "/none"))
    assert keeper.spare is not None
    proc = keeper.spare.proc
    deadline = time.monotonic() + 120
    while ready_line(tmp_path / "spare.log", proc.pid) is None and time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "spare.log").read_text()
        time.sleep(0.2)
    return keeper, log


@pytest.mark.slow
def test_a_sigstopped_real_spare_is_discarded_within_seconds_not_the_hang_timeout(tmp_path: Path) -> None:
    """A real spare, ready and then SIGSTOPped, is killed at the hand-over within seconds and not used."""
    keeper, log = _ready_real_spare(tmp_path)
    assert keeper.spare is not None
    proc = keeper.spare.proc
    os.kill(proc.pid, signal.SIGSTOP)
    handed = time.monotonic()
    assert keeper.take(keeper.spare.order, tmp_path / "spec.json", tmp_path / "child.log") is None
    assert time.monotonic() - handed < 15
    assert proc.poll() is not None  # killed (a stopped process ends by the SIGKILL) and reaped
    name, fields = log.lines[-1]
    assert name == "spare_discarded" and "no acknowledgement" in fields["why"]


@pytest.mark.slow
def test_a_ready_real_spare_acknowledges_the_spec_at_once_and_is_handed_the_attempt(tmp_path: Path) -> None:
    """A real, ready spare writes spare_ack within the wait and the keeper hands it the attempt."""
    keeper, log = _ready_real_spare(tmp_path)
    assert keeper.spare is not None
    proc = keeper.spare.proc
    handed = time.monotonic()
    taken = keeper.take(keeper.spare.order, tmp_path / "missing-spec.json", tmp_path / "child.log")
    assert taken is proc and time.monotonic() - handed < 5
    assert log.names()[-1] == "spare_used"
    # The spec does not exist: the attempt it became ends with the config-error code, in its log.
    assert _exit_status(proc) == 71 and "cannot read attempt spec" in (tmp_path / "child.log").read_text()


def _exit_status(proc: Any) -> int:
    return int(proc.popen.wait(timeout=60))
