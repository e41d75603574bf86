"""Waiting between attempts: backoff before an unchanged retry, and waiting for GPU memory.

The memory wait is a tenacity ``Retrying`` as its authors mean it: retry while the free
reading is short (``retry_if_result``), poll with exponential backoff and jitter (so several
supervisors on one card do not poll in step), stop after the job's timeout or when a stop was
requested (``stop_when_event_set``), and sleep with the loop's interruptible sleep.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import tenacity


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
