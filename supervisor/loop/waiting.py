"""Waiting, on the loop's clock: the backoff before an unchanged retry, and polls for GPU memory or
room on the disk. One backoff series paces every wait, with jitter between polls so supervisors
sharing a card do not poll in step; every pause goes through one interruptible :class:`Pacer`."""

from __future__ import annotations

import dataclasses
import itertools
import random
import signal
from collections.abc import Callable, Sequence

from structlog.typing import FilteringBoundLogger

from qlora_supervise.policies import decide as policy
from qlora_supervise.supervisor.exit_codes import SupervisorExitCode
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.loop.child import Clock, Sleep
from qlora_supervise.supervisor.record import rundir
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.journal import AttemptRecord, Outcome
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.reporting import notify
from qlora_supervise.supervisor.watching.gpu import GpuProbe
from qlora_supervise.trainer_child.contract.codes import FailureKind


def backoff_s(n: int, initial_s: float, max_s: float) -> float:
    """The n-th pause of the series (n from 1): initial, 2x initial, 4x initial, ... capped at max."""
    return float(min(max_s, initial_s * 2 ** max(0, n - 1)))


def failures_in_a_row(records: Sequence[AttemptRecord]) -> int:
    """How many of the last journal lines are failures: the term of the series the next retry waits."""
    return sum(1 for _ in itertools.takewhile(lambda r: r.outcome is Outcome.FAILED, reversed(records)))


@dataclasses.dataclass
class Pacer:
    """The loop's one way to pass time: in ticks of the sleep seam, measured on the clock seam;
    ``stop_requested`` ends a pause at the next tick, and each tick feeds systemd's watchdog."""

    clock: Clock
    sleep: Sleep
    tick_s: float
    stop_requested: Callable[[], bool]
    watchdog_every_s: float | None = dataclasses.field(default_factory=notify.watchdog_interval_s)
    _last_ping: float = -1e18

    def pause(self, seconds: float) -> None:
        """Sleep ``seconds`` on the clock seam, or less when a stop is requested."""
        deadline = self.clock() + seconds
        while not self.stop_requested() and self.clock() < deadline:
            now = self.clock()
            if self.watchdog_every_s is not None and now - self._last_ping >= self.watchdog_every_s / 2:
                notify.watchdog()
                self._last_ping = now
            self.sleep(min(self.tick_s, max(0.0, deadline - self.clock())))


def poll_until(
    read: Callable[[], int | None], needed: int, timeout_s: float, pacing: tuple[float, float], pacer: Pacer
) -> int | None:
    """Read until a reading reaches ``needed``, ``timeout_s`` passes or a stop is requested; the
    last reading (None: no reading at all, at once). ``pacing``: the job's (initial, max) backoff;
    each pause is the series' next term plus up to ``initial`` of jitter, never past the timeout."""
    started = pacer.clock()
    initial_s, max_s = pacing
    n = 0
    while True:
        n += 1
        value = read()
        left = timeout_s - (pacer.clock() - started)
        if value is None or value >= needed or pacer.stop_requested() or left <= 0:
            return value
        pause = min(max_s, backoff_s(n, initial_s, max_s) + random.uniform(0.0, initial_s))
        pacer.pause(min(left, pause))


def _timed_poll(
    read: Callable[[], int | None], needed: int, timeout_s: float, pacing: tuple[float, float], pacer: Pacer
) -> tuple[int | None, float]:
    started = pacer.clock()
    return poll_until(read, needed, timeout_s, pacing, pacer), pacer.clock() - started


def wait_for_memory(
    gpu: GpuProbe | None,
    wait: policy.Wait,
    failure: Failure,
    log: FilteringBoundLogger,
    pacer: Pacer,
    pacing: tuple[float, float],
) -> policy.WaitResult:
    """Carry out the policy's Wait: poll NVML until the memory is back, the timeout, or a stop."""
    log.info(
        Event.WAITING_FOR_MEMORY,
        why=wait.why,
        needed_bytes=wait.needed_bytes,
        timeout_s=wait.seconds,
        numbers=failure.numbers_json(),
    )

    def free_now() -> int | None:
        return sample.free if gpu is not None and (sample := gpu.sample(set())) else None

    free, waited = _timed_poll(free_now, wait.needed_bytes, wait.seconds, pacing, pacer)
    event = Event.NO_MEMORY_READING if free is None else Event.MEMORY_WAIT_TIMED_OUT
    if free is not None and free >= wait.needed_bytes:
        event = Event.MEMORY_AVAILABLE
    log.info(event, free_bytes=free, waited_s=round(waited, 1))
    return policy.WaitResult(free, waited, stopped=pacer.stop_requested())


@dataclasses.dataclass
class DiskWaiter:
    """Waits out a full disk (the child's ``disk_full`` and the supervisor's own failed writes):
    frees what is the run's own to free, says where room is needed and how much, and polls until
    there is room, ``disk_wait`` has passed, or a stop. The arbiter owns one per run."""

    rd: RunDir
    log: FilteringBoundLogger
    pacer: Pacer
    wait_s: float
    pacing: tuple[float, float]  # the job's (initial, max) backoff between polls

    def verdict(self, stop_signal: int | None) -> int:
        """No room came back in time (exit 3), or a stop came first (resumable): nothing to journal."""
        if stop_signal is not None:
            self.log.info(Event.STOPPED, signal=signal.Signals(stop_signal).name, resumable=True)
            return 128 + int(stop_signal)
        why = f"no room on the disk for {self.wait_s:.0f}s (supervise.disk_wait)"
        self.log.error(Event.GAVE_UP, why=why, resumable="free space and run the same command again")
        return int(SupervisorExitCode.GAVE_UP)

    def explain(self, failure: Failure) -> Failure:
        """``other`` with no room left on the run's disk is ``disk_full`` (no room to say so)."""
        if failure.kind is not FailureKind.OTHER or rundir.room_free(self.rd) >= rundir.MIN_ROOM:
            return failure
        free = format_bytes(rundir.room_free(self.rd))
        why = f"{failure.evidence}; the run's disk has {free} free (below {format_bytes(rundir.MIN_ROOM)})"
        return dataclasses.replace(failure, kind=FailureKind.DISK_FULL, evidence=why)

    def with_room_needed(self, failure: Failure) -> Failure:
        """The child's ``disk_full`` with what it needs (at least the last checkpoint) and what is free."""
        self._free_ours()
        reported = failure.numbers.get("needed_bytes")
        needed = rundir.room_needed(self.rd, reported if isinstance(reported, int) else None)
        numbers = {**failure.numbers, "needed_bytes": needed, "free_bytes": rundir.room_free(self.rd)}
        return dataclasses.replace(failure, numbers=numbers)

    def wait(self, wait: policy.Wait) -> policy.WaitResult:
        """Carry out the policy's Wait for the disk: poll until ``needed_bytes`` are free."""
        self._warn(Event.WAITING_FOR_DISK, wait.needed_bytes, wait.seconds, why=wait.why)
        return self._poll(wait.needed_bytes, wait.seconds)

    def outlast(self, exc: OSError) -> bool:
        """The supervisor's own write failed for room: free, explain, wait. True: room is back."""
        self._free_ours()
        needed = rundir.room_needed(self.rd)
        self._warn(Event.SUPERVISOR_DISK_FULL, needed, self.wait_s, error=str(exc))
        result = self._poll(needed, self.wait_s)
        return not result.stopped and result.free_bytes is not None and result.free_bytes >= needed

    def _warn(self, event: Event, needed: int, timeout_s: float, **why: str) -> None:
        free_now = rundir.room_free(self.rd)
        words = rundir.room_words(self.rd, needed, free_now)
        self.log.warning(
            event, **why, words=words, needed_bytes=needed, free_bytes=free_now, timeout_s=timeout_s
        )

    def _poll(self, needed: int, timeout_s: float) -> policy.WaitResult:
        rd = self.rd
        free, waited = _timed_poll(lambda: rundir.room_free(rd), needed, timeout_s, self.pacing, self.pacer)
        room = free is not None and free >= needed
        event = Event.DISK_ROOM_AVAILABLE if room else Event.DISK_WAIT_TIMED_OUT
        self.log.info(event, free_bytes=free, needed_bytes=needed, waited_s=round(waited, 1))
        return policy.WaitResult(free, waited, stopped=self.pacer.stop_requested())

    def _free_ours(self) -> None:
        if freed := rundir.free_ours(self.rd):
            self.log.info(Event.STAGING_FREED, freed_bytes=freed, where=str(self.rd.root))
