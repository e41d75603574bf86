"""Waiting between attempts: backoff before an unchanged retry, and waiting for GPU memory.

The memory wait is a tenacity ``Retrying`` as its authors mean it: retry while the free
reading is short (``retry_if_result``), poll with exponential backoff and jitter (so several
supervisors on one card do not poll in step), stop after the job's timeout or when a stop was
requested (``stop_when_event_set``), and sleep with the loop's interruptible sleep.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import tenacity

from qlora_supervise.policies.decide import Wait, WaitResult
from qlora_supervise.supervisor.diagnosis.failure import Failure
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.watching.gpu import GpuProbe


def backoff_seconds(failures_in_a_row: int, initial_s: float, max_s: float) -> float:
    """initial, 2x initial, 4x initial, ... capped at max: the pause before an unchanged retry."""
    return float(min(max_s, initial_s * 2 ** max(0, failures_in_a_row - 1)))


def wait_for_free_memory(
    read_free: Callable[[], int | None],
    needed: int,
    timeout_s: float,
    initial_s: float,
    max_s: float,
    sleep: Callable[[float], None],
    stop_requested: threading.Event,
) -> int | None:
    """Poll ``read_free`` until it reports ``needed`` bytes, the timeout, or a stop request.

    Returns the last reading (None: no reading at all, e.g. no NVML: returns at once).
    """
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_delay(timeout_s) | tenacity.stop_when_event_set(stop_requested),
        wait=tenacity.wait_exponential_jitter(multiplier=initial_s, max=max_s, jitter=initial_s),
        # No reading at all (no NVML): nothing to wait on; the loop's backoff paces the retry.
        retry=tenacity.retry_if_result(lambda free: free is not None and free < needed),
        sleep=sleep,
        retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
    )
    result: int | None = retrying(read_free)
    return result


def wait_for_memory(
    gpu: GpuProbe | None,
    wait: Wait,
    failure: Failure,
    log: Any,
    clock: Callable[[], float],
    sleep: Callable[[float], None],
    stop_requested: threading.Event,
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
        numbers=dict(failure.numbers),
    )

    def free_now() -> int | None:
        sample = gpu.sample(set()) if gpu is not None else None
        return sample.free if sample else None

    started = clock()
    free = wait_for_free_memory(free_now, wait.needed_bytes, wait.seconds, *pacing, sleep, stop_requested)
    waited = clock() - started
    if free is None:
        event = Event.NO_MEMORY_READING
    else:
        event = Event.MEMORY_AVAILABLE if free >= wait.needed_bytes else Event.MEMORY_WAIT_TIMED_OUT
    log.info(event, free_bytes=free, waited_s=round(waited, 1))
    return WaitResult(free, waited, stopped=stop_requested.is_set())
