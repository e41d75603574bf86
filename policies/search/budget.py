"""The budgets the policy plans against: the card's (less what sits outside the allocator) and the
host's (:class:`HostBudget`). ``plan`` and the loop use the same functions."""

from __future__ import annotations

import math
from dataclasses import dataclass

from qlora_supervise.policies.memory import gpu as gpu_terms


def card_reserve(paged_bytes: int = 0) -> int:
    """Bytes of a card kept out of the budget: the CUDA context plus paged optimizer state."""
    return gpu_terms.CUDA_CONTEXT + paged_bytes


def card_budget(total_bytes: int, paged_bytes: int = 0) -> int:
    """The budget on a whole card of ``total_bytes``: its total less :func:`card_reserve`."""
    return max(0, total_bytes - card_reserve(paged_bytes))


#: Host RAM kept out of the host budget when it is read from the machine: the supervisor, the
#: shell and the page cache the system needs (1 GiB, or 5 % of a larger host).
HOST_RESERVE_MIN = 1 << 30
HOST_RESERVE_FRACTION = 0.05


@dataclass(frozen=True)
class HostBudget:
    """The host RAM a training child may use, and what the host model counts against it;
    ``source``: ``flag`` (``plan --host-memory``), ``job`` (``resources.host_memory_limit``) or
    ``available`` (see :func:`host_budget`)."""

    budget_bytes: int
    checkpoint_bytes: int
    source: str
    reserve_bytes: int = 0
    largest_shard_bytes: int | None = None  # the checkpoint's largest file (None: not known)


def host_reserve(total_bytes: int) -> int:
    """Bytes of a host of ``total_bytes`` kept out of its budget (:data:`HOST_RESERVE_MIN` at least)."""
    return max(HOST_RESERVE_MIN, int(total_bytes * HOST_RESERVE_FRACTION))


def host_for_budget(budget_bytes: int) -> int:
    """The smallest host size whose budget (the host less :func:`host_reserve`) is ``budget_bytes``
    at least: what ``plan --host-memory`` must be told for that budget."""
    if budget_bytes <= 0:
        return 0
    size = budget_bytes + HOST_RESERVE_MIN
    if host_reserve(size) > HOST_RESERVE_MIN:  # the reserve is a fraction of the host there
        size = math.ceil(budget_bytes / (1 - HOST_RESERVE_FRACTION))
        while size - 1 - host_reserve(size - 1) >= budget_bytes:
            size -= 1
    return size


def host_budget(
    checkpoint_bytes: int,
    available_bytes: int,
    cgroup_limit: int | None = None,
    job_limit: int | None = None,
    host_size: int | None = None,
    largest_shard_bytes: int | None = None,
) -> HostBudget:
    """The host budget, first match wins: a stated host size less the reserve; the job's
    ``host_memory_limit`` as it is; what is available now, capped by the cgroup, less the reserve."""
    shard = largest_shard_bytes or None
    if host_size is not None:
        reserve = host_reserve(host_size)
        return HostBudget(max(0, host_size - reserve), checkpoint_bytes, "flag", reserve, shard)
    if job_limit is not None:
        return HostBudget(job_limit, checkpoint_bytes, "job", 0, shard)
    room = available_bytes if cgroup_limit is None else min(available_bytes, cgroup_limit)
    reserve = host_reserve(room)
    return HostBudget(max(0, room - reserve), checkpoint_bytes, "available", reserve, shard)
