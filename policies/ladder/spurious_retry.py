"""A spurious OOM: the same config retried once before any rung (issue 33).

The classifier marks an OOM spurious when the allocator's own numbers say the request fit
(supervisor/diagnosis/fragmentation.py); a repeat right after the retry, before any step, is the config's.
"""

from __future__ import annotations

from collections.abc import Sequence

from qlora_supervise.policies.rungs import Survives
from qlora_supervise.policies.verdicts import FailureLike, PastAttempt, Restart
from qlora_supervise.trainer_child.contract.spec import Knobs

#: The key in a failure's numbers that marks it spurious: the bytes that were there for the request.
SPURIOUS_KEY = "spurious_room"
RETRY_RUNG = "retry_spurious"  # The rung name journalled for the retry.


def retry_spurious(failure: FailureLike, knobs: Knobs, failed: Sequence[PastAttempt]) -> Restart | None:
    """Restart unchanged when ``failure`` is marked spurious and ``knobs`` had no such retry yet;
    ``failed``: the failed attempts, this one last. None: the ladder decides."""
    if SPURIOUS_KEY not in failure.numbers or not failed:
        return None
    if any(past.rung == RETRY_RUNG and past.knobs == knobs for past in failed[:-1]):
        return None  # once per config (issue 33): the ladder takes a second spurious OOM
    before = failed[-2] if len(failed) > 1 else None
    again = before is not None and before.kind is failure.kind and before.knobs == knobs
    if again and failed[-1].steps_progressed <= 0:
        return None  # the retry was had and failed the same way at once: the config's own
    why = (
        f"{failure.kind.value} looks spurious (the allocator's numbers say the request fit: "
        f"{int(failure.numbers[SPURIOUS_KEY]) / 1024**2:.0f} MiB were there for it): retry the same "
        "config once before any rung"
    )
    return Restart(knobs, RETRY_RUNG, {}, why, Survives.ALL)
