"""Waiting, on the loop's clock: the backoff before an unchanged retry, and polls for memory or room.

One backoff series paces every wait (:func:`backoff_s`: initial, 2x, 4x, ... capped at max): the
n-th unchanged retry in a row pauses its n-th term, and a poll (:func:`poll_until`) pauses the next
term between two readings, with jitter so that several supervisors on one card do not poll in step.
Every pause goes through one :class:`Pacer`, which reads the clock seam, sleeps through the sleep
seam in ticks, ends early on a stop request and feeds systemd's watchdog meanwhile: a wait of an
hour is as interruptible as a tick, and the fake-clock tests run it in microseconds.

(tenacity paced the polls until issue 18; the backoff between attempts cannot be one
``Retrying`` call, so it kept a second series of its own. One small loop replaced both.)
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

from structlog.typing import FilteringBoundLogger

from qlora_supervise.policies.decide import Wait, WaitResult
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.supervisor.loop.seams import Clock, Sleep
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.records import AttemptRecord, Outcome
from qlora_supervise.supervisor.reporting import notify
from qlora_supervise.supervisor.watching.gpu import GpuProbe


def backoff_s(n: int, initial_s: float, max_s: float) -> float:
    """The n-th pause of the series (n from 1): initial, 2x initial, 4x initial, ... capped at max."""
    return float(min(max_s, initial_s * 2 ** max(0, n - 1)))


def failures_in_a_row(records: Sequence[AttemptRecord]) -> int:
    """How many of the last journal lines are failures: the term of the series the next retry waits."""
    count = 0
    for record in reversed(records):
        if record.outcome is not Outcome.FAILED:
            break
        count += 1
    return count


@dataclasses.dataclass
class Pacer:
    """The loop's one way to pass time: in ticks of the sleep seam, measured on the clock seam.

    ``stop_requested`` ends a pause at the next tick (a signal handler sets it); each tick feeds
    systemd's watchdog (``WatchdogSec=`` wants a sign of life at least every interval).
    """

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
            self._ping(self.clock())
            self.sleep(min(self.tick_s, max(0.0, deadline - self.clock())))

    def _ping(self, now: float) -> None:
        if self.watchdog_every_s is not None and now - self._last_ping >= self.watchdog_every_s / 2:
            notify.watchdog()
            self._last_ping = now


def poll_until(
    read: Callable[[], int | None],
    needed: int,
    timeout_s: float,
    pacing: tuple[float, float],
    pacer: Pacer,
) -> int | None:
    """Read until a reading reaches ``needed``, ``timeout_s`` passes on the clock seam, or a stop is
    requested; returns the last reading (None: no reading at all, e.g. no NVML: at once).

    ``pacing`` is the job's (initial, max) backoff; a poll pauses the series' next term plus up to
    ``initial`` of jitter, never past the timeout.
    """
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


def wait_for_memory(
    gpu: GpuProbe | None,
    wait: Wait,
    failure: Failure,
    log: FilteringBoundLogger,
    pacer: Pacer,
    pacing: tuple[float, float],
) -> WaitResult:
    """Carry out the policy's Wait: poll NVML until the memory is back, the timeout, or a stop.

    ``pacing`` is the job's (initial, max) backoff between polls; the events say what happened.
    """
    log.info(
        Event.WAITING_FOR_MEMORY,
        why=wait.why,
        needed_bytes=wait.needed_bytes,
        timeout_s=wait.seconds,
        numbers=failure.numbers_json(),
    )

    def free_now() -> int | None:
        sample = gpu.sample(set()) if gpu is not None else None
        return sample.free if sample else None

    started = pacer.clock()
    free = poll_until(free_now, wait.needed_bytes, wait.seconds, pacing, pacer)
    waited = pacer.clock() - started
    if free is None:
        event = Event.NO_MEMORY_READING
    else:
        event = Event.MEMORY_AVAILABLE if free >= wait.needed_bytes else Event.MEMORY_WAIT_TIMED_OUT
    log.info(event, free_bytes=free, waited_s=round(waited, 1))
    return WaitResult(free, waited, stopped=pacer.stop_requested())
