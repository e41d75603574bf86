"""Waiting between attempts: exponential backoff, and waiting for GPU memory held by others.

Both use tenacity's strategies (``wait_exponential``, ``stop_after_delay``) so the numbers
follow one well-known rule; the sleeping itself is the loop's, interruptible by a stop signal.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import tenacity


def backoff_seconds(failures_in_a_row: int, initial_s: float, max_s: float) -> float:
    """initial, 2x initial, 4x initial, ... capped at max (tenacity's wait_exponential)."""
    wait = tenacity.wait_exponential(multiplier=initial_s, min=initial_s, max=max_s)
    state = tenacity.RetryCallState(retry_object=None, fn=None, args=(), kwargs={})  # type: ignore[arg-type]
    state.attempt_number = max(1, failures_in_a_row)
    return float(wait(state))


def bytes_needed(numbers: Mapping[str, Any]) -> int:
    """What the failed process held plus what it asked for: the memory it needs to get past."""
    held = numbers.get("process_in_use") or numbers.get("already_allocated") or 0
    return int(held) + int(numbers.get("tried_to_allocate") or 0)


class _StopWhen(tenacity.stop.stop_base):
    def __init__(self, predicate: Callable[[], bool]) -> None:
        self._predicate = predicate

    def __call__(self, retry_state: tenacity.RetryCallState) -> bool:
        return self._predicate()


def wait_for_free_memory(
    read_free: Callable[[], int | None],
    needed: int,
    timeout_s: float,
    initial_s: float,
    max_s: float,
    sleep: Callable[[float], None],
    stop_asked: Callable[[], bool],
) -> int | None:
    """Poll ``read_free`` with backoff until it reports ``needed`` bytes, the timeout, or a stop.

    Returns the last reading (None: no reading at all, e.g. no NVML: returns at once).
    """
    retrying = tenacity.Retrying(
        stop=tenacity.stop_after_delay(timeout_s) | _StopWhen(stop_asked),
        wait=tenacity.wait_exponential(multiplier=initial_s, min=initial_s, max=max_s),
        # No reading at all (no NVML): nothing to wait on; the loop's backoff paces the retry.
        retry=tenacity.retry_if_result(lambda free: free is not None and free < needed),
        sleep=sleep,
        retry_error_callback=lambda state: state.outcome.result() if state.outcome else None,
    )
    result: int | None = retrying(read_free)
    return result
