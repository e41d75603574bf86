"""Every wait of the loop on the injected clock, and the child's stop through ``psutil.wait_procs``.

The polls and pauses run on a fake clock (an hour's timeout in microseconds); the stops are
real processes, since a grace period is what a real process gets.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from qlora_supervise.policies.decide import Wait, WaitFor
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.supervisor.loop import child as child_mod
from qlora_supervise.supervisor.loop.waiting import DiskWaiter, Pacer, backoff_s, poll_until, wait_for_memory
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.watching.gpu import GpuSample
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage

GiB = 1024**3


class FakeClock:
    """Time that moves only when the code under test sleeps; it keeps every sleep."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


class Log:
    """A structlog stand-in that keeps (event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.events.append((str(event), fields))

    warning = info

    def names(self) -> list[str]:
        return [name for name, _ in self.events]


def _pacer(clock: FakeClock, stop: list[bool] | None = None, tick_s: float = 0.5) -> Pacer:
    flag = stop if stop is not None else [False]
    return Pacer(clock, clock.sleep, tick_s, lambda: flag[0], watchdog_every_s=None)


def test_the_backoff_series_doubles_from_initial_and_is_capped() -> None:
    """The one backoff series: initial, 2x, 4x, ... never above max."""
    assert [backoff_s(n, 5.0, 60.0) for n in range(1, 7)] == [5.0, 10.0, 20.0, 40.0, 60.0, 60.0]


def test_a_pause_is_slept_in_ticks_on_the_clock_seam() -> None:
    """A pause of 2 s with a 0.5 s tick is four sleeps of the sleep seam, measured on the clock seam."""
    clock = FakeClock()
    _pacer(clock).pause(2.0)
    assert clock.sleeps == [0.5, 0.5, 0.5, 0.5] and clock.now == 1002.0


def test_a_stop_request_ends_a_pause_at_the_next_tick() -> None:
    """An hour's pause ends within one tick of a stop request."""
    clock, stop = FakeClock(), [False]

    def sleep(seconds: float) -> None:
        clock.sleep(seconds)
        stop[0] = clock.now >= 1001.0

    Pacer(clock, sleep, 0.5, lambda: stop[0], watchdog_every_s=None).pause(3600.0)
    assert clock.now == 1001.0


def test_a_poll_times_out_on_the_clock_seam_not_the_wall_clock() -> None:
    """A poll that never sees enough ends after its timeout on the fake clock, in no wall time to speak of."""
    clock, readings = FakeClock(), []
    started = time.monotonic()

    def read() -> int:
        readings.append(clock.now)
        return 1

    assert poll_until(read, 10, 1800.0, (5.0, 60.0), _pacer(clock)) == 1
    assert clock.now == 1000.0 + 1800.0  # the last pause was cut to the timeout
    assert time.monotonic() - started < 0.5
    # A gap is a difference of two float sums on the fake clock; it may land an ulp beyond its pause.
    ulp = 1e-9
    gaps = [b - a for a, b in itertools.pairwise(readings)]
    assert 5.0 - ulp <= gaps[0] <= 10.0 + ulp and 10.0 - ulp <= gaps[1] <= 15.0 + ulp  # series + jitter
    assert all(gap <= 60.0 + ulp for gap in gaps)


def test_a_poll_returns_at_once_with_no_reading_or_enough() -> None:
    """No reading (no NVML) or a reading that is enough ends the poll without a pause."""
    clock = FakeClock()
    assert poll_until(lambda: None, 10, 60.0, (1.0, 4.0), _pacer(clock)) is None
    assert poll_until(lambda: 10, 10, 60.0, (1.0, 4.0), _pacer(clock)) == 10
    assert clock.sleeps == []


def test_the_memory_wait_times_out_on_the_fake_clock_and_says_so() -> None:
    """The memory wait's timeout is on the clock seam: 30 min pass on the fake clock, then it gives up."""
    clock, log = FakeClock(), Log()

    class Held:
        def sample(self, pids: set[int]) -> GpuSample:
            return GpuSample(time.time(), 0, 24 * GiB, 23 * GiB, 1 * GiB, 0, ())

        def close(self) -> None:
            pass

    failure = Failure(FailureKind.OOM_CONTENTION, Stage.FORWARD, {}, "test")
    wait = Wait(1800.0, 8 * GiB, "another process holds the card")
    result = wait_for_memory(Held(), wait, failure, log, _pacer(clock), (5.0, 60.0))  # type: ignore[arg-type]
    assert result.free_bytes == GiB and not result.stopped and result.waited_s == 1800.0
    assert log.names() == ["waiting_for_memory", "memory_wait_timed_out"]


def test_the_disk_wait_times_out_on_the_fake_clock(tmp_path: Path) -> None:
    """Room that never comes back: the disk wait ends after its timeout on the fake clock, stopped=False."""
    clock, log = FakeClock(), Log()
    rd = RunDir(tmp_path)
    waiter = DiskWaiter(rd, log, _pacer(clock), 3600.0, (5.0, 60.0))  # type: ignore[arg-type]
    more_than_the_disk = 1 << 62
    result = waiter.wait(Wait(3600.0, more_than_the_disk, "no room", WaitFor.DISK))
    assert result.waited_s == 3600.0 and not result.stopped and result.free_bytes is not None
    assert log.names() == ["waiting_for_disk", "disk_wait_timed_out"]


def test_a_stop_request_ends_the_disk_wait_as_stopped(tmp_path: Path) -> None:
    """A stop request during the wait for room ends it at the next tick and says it was stopped."""
    clock, log, stop = FakeClock(), Log(), [False]

    def sleep(seconds: float) -> None:  # the signal comes during the first tick
        clock.sleep(seconds)
        stop[0] = True

    pacer = Pacer(clock, sleep, 0.5, lambda: stop[0], watchdog_every_s=None)
    waiter = DiskWaiter(RunDir(tmp_path), log, pacer, 3600.0, (5.0, 60.0))  # type: ignore[arg-type]
    result = waiter.wait(Wait(3600.0, 1 << 62, "no room", WaitFor.DISK))
    assert result.stopped and result.waited_s == 0.5


def _popen(on_term: str) -> subprocess.Popen[bytes]:
    """A child in its own session, with ``on_term`` as its SIGTERM handler; it says ``ready`` once set."""
    script = (
        f"import signal, sys, time; signal.signal(signal.SIGTERM, {on_term}); "
        "print('ready', flush=True); time.sleep(60)"
    )
    return subprocess.Popen([sys.executable, "-c", script], start_new_session=True, stdout=subprocess.PIPE)


def _ready(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None and proc.stdout.readline() == b"ready\n"


def test_a_child_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    """TERM, the grace (psutil.wait_procs), then KILL: the status says SIGKILL, and the grace was waited."""
    proc = _popen("signal.SIG_IGN")
    _ready(proc)
    child = child_mod.ChildProcess(proc, time.monotonic())
    started = time.monotonic()
    assert child.stop(0.5) == -9
    assert 0.5 <= time.monotonic() - started < 5.0
    assert proc.returncode == -9  # Popen agrees, and will not wait for it again


def test_a_child_that_exits_on_sigterm_is_not_waited_for_the_whole_grace() -> None:
    """A child that checkpoints and exits on SIGTERM returns its own status long before the grace ends."""
    proc = _popen("lambda *a: sys.exit(75)")
    _ready(proc)
    started = time.monotonic()
    assert child_mod.ChildProcess(proc, started).stop(30.0) == 75
    assert time.monotonic() - started < 5.0


def test_an_orphan_is_stopped_by_its_group_and_a_gone_one_is_left_alone() -> None:
    """A group that ignores SIGTERM is killed after the grace; a pid that is gone is no error."""
    proc = _popen("signal.SIG_IGN")
    _ready(proc)
    assert child_mod.stop_group(proc.pid, 0.3) == -9  # ours here, so psutil reaps it
    assert child_mod.stop_group(proc.pid, 0.3) is None


def test_a_zero_grace_kills_at_once() -> None:
    """With no grace at all the group is killed at once (a hung child given none)."""
    proc = _popen("signal.SIG_IGN")
    _ready(proc)
    started = time.monotonic()
    assert child_mod.ChildProcess(proc, started).stop(0.0) == -9
    assert time.monotonic() - started < 5.0
