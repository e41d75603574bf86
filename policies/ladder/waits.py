"""Rules that wait or leave a card out: contention, a full disk, a GPU that faults.

Contention (the job does not allow degrading): wait for the memory, then restart unchanged, or
give up when the wait timed out. A full disk: wait for room, then restart unchanged. A fatal Xid
gives up on that GPU. Under torchrun, a card that keeps failing is left out (``drop_rank``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qlora_supervise.policies.ladder.ladders import CARD_FAILING
from qlora_supervise.policies.rungs import RungContext, Survives, rung_by_name
from qlora_supervise.policies.search.search_result import knob_changes
from qlora_supervise.policies.verdicts import (
    Decision,
    FailureLike,
    GiveUp,
    Restart,
    Settings,
    Wait,
    WaitFor,
    WaitResult,
)
from qlora_supervise.trainer_child.contract.spec import Knobs


def gpu_broken(failure: FailureLike) -> GiveUp:
    """A fatal Xid: the GPU must be reset or replaced; no config, and no retry, helps on it."""
    code = failure.fatal_xid
    return GiveUp(
        f"the GPU reported fatal Xid {code}: it needs a reset (nvidia-smi -r) or a hardware check; "
        "nothing was retried on it (the checkpoints are kept)",
        retryable=False,
    )


def bytes_needed(numbers: Mapping[str, Any]) -> int:
    """What the failed process held plus what it asked for: the memory it needs to get past."""
    held = numbers.get("process_in_use") or numbers.get("already_allocated") or 0
    return int(held) + int(numbers.get("tried_to_allocate") or 0)


def after_contention(
    failure: FailureLike, knobs: Knobs, settings: Settings, waited: WaitResult | None
) -> Decision:
    needed = bytes_needed(failure.numbers)
    if waited is None:
        return Wait(settings.contention_wait_s, needed, "other processes hold the GPU memory this job needs")
    if waited.free_bytes is None:
        why = "no NVML reading to wait on: retry the same config after the backoff"
        return Restart(knobs, "wait_for_memory", {}, why, Survives.ALL)
    if waited.free_bytes >= needed:
        return Restart(knobs, "wait_for_memory", {}, "the other processes released the memory", Survives.ALL)
    kept = GiveUp(
        f"other processes kept the GPU memory for {settings.contention_wait_s:.0f}s "
        "and supervise.degrade_on_contention is false"
    )
    return without_card(failure, knobs, "other processes kept one card's memory") or kept


def without_card(failure: FailureLike, knobs: Knobs, why: str) -> Restart | None:
    """Under torchrun, the restart on the other cards (``drop_rank``) when one card keeps failing;
    None for a single process or where the effective batch cannot be kept exactly."""
    # A failure of the supervisor's (diagnosis.Failure) names the rank that caused it; one that
    # does not (a single process, a caller's own failure type) leaves the last card out.
    context = RungContext(failed_local_rank=getattr(failure, "local_rank", None))
    for rung in (rung_by_name(name, context) for name in CARD_FAILING):
        dropped = rung.apply(knobs)
        if dropped is not None:
            changes = knob_changes(knobs, dropped)
            return Restart(dropped, rung.name, changes, f"{why}: {rung.reason}", rung.survives)
    return None


def after_disk_full(
    failure: FailureLike, knobs: Knobs, settings: Settings, waited: WaitResult | None
) -> Decision:
    needed = int(failure.numbers.get("needed_bytes") or 0)
    if waited is None:
        why = "the disk holding the run directory has no room for a checkpoint"
        return Wait(settings.disk_wait_s, needed, why, WaitFor.DISK)
    if waited.free_bytes is None or waited.free_bytes >= needed:
        return Restart(knobs, "wait_for_disk", {}, "there is room on the disk again", Survives.ALL)
    return GiveUp(
        f"the disk stayed without room for a checkpoint ({needed} bytes) for "
        f"{settings.disk_wait_s:.0f}s (supervise.disk_wait): free space there and run the same command again"
    )
