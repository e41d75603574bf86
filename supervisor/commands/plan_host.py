"""The host side of ``plan``: the host budget it plans against, and what it reports of host RAM
(the load and the merge, as measured; training's need by component for the start, with its basis)."""

from __future__ import annotations

from typing import Any

from qlora_supervise.policies.memory.host import (
    CPU_IMPORTS_RSS,
    IMPORTS_RSS,
    HostNeed,
    host_need,
    host_train_need,
)
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.policies.search.budget import HostBudget, host_budget
from qlora_supervise.policies.search.search_result import PreflightResult
from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.supervisor.facts.units import UnitError, parse_memory_size
from qlora_supervise.supervisor.jobfile import Job
from qlora_supervise.supervisor.watching import host as host_memory
from qlora_supervise.supervisor.watching.gpu import visible_gpu_count
from qlora_supervise.trainer_child.contract.spec import Knobs


def find_host(
    checkpoint_bytes: int, job: Job, host_size: int | None, largest_shard_bytes: int = 0
) -> HostBudget | None:
    """The host budget (see the module docstring for the order); None on the CPU, where the
    child's memory is the card's model's no longer (``cpu_memory_limit`` caps it there)."""
    if job.resources.device == "cpu":
        return None
    available, cgroup = host_memory.host_room()  # through the module: the tests' one seam
    limit = job.resources.host_memory_limit
    return host_budget(checkpoint_bytes, available, cgroup, limit, host_size, largest_shard_bytes)


def size_flag(flag: str, value: str | None) -> int | None:
    """A size flag's bytes; a bad one is a bad command line (exit 2), named."""
    if value is None:
        return None
    try:
        return parse_memory_size(value)
    except UnitError as error:
        raise SupervisorExit(SupervisorExitCode.BAD_JOB, f"{flag} {value!r}: {error}") from None


def host_training(
    shape: ModelShape | None,
    knobs: Knobs,
    targets: tuple[str, ...] | str,
    host: HostBudget | None,
    start: PreflightResult | None,
) -> dict[str, Any]:
    """The host budget and the start's (else ``knobs``') training host peak by component, with its basis."""
    need = None
    if shape is not None and host is not None:
        knobs = knobs if start is None else start.knobs
        need = host_train_need(shape, knobs, host.checkpoint_bytes, targets, host.largest_shard_bytes)
    rejected, smallest = (0, None) if start is None else start.host_rejected
    return {
        "budget_bytes": None if host is None else host.budget_bytes,
        "budget_source": None if host is None else host.source,
        "reserve_bytes": 0 if host is None else host.reserve_bytes,
        "train_peak_bytes": None if need is None else need.peak_bytes,
        "train_phase": None if need is None else need.phase,
        "train_phase_bytes": None if need is None else need.train_peak,
        "train_components": {} if need is None else dict(need.train_components),
        "train_basis": "" if need is None else need.basis,
        "rejected": rejected,
        "rejected_smallest_bytes": smallest,
    }


def host_ram(checkpoint: int | None, largest_shard: int, job: Job) -> dict[str, Any]:
    """The load's and the merge's host RAM as measured (RSS, the mapped checkpoint included), and
    whether the load's need (imports + its largest shard in the page cache) fits the room there is:
    the smallest of what is available, the cgroup's limit and ``cpu_memory_limit``, named."""
    available, limit = host_memory.host_room()  # through the module: the tests' one seam
    resources = job.resources
    on_gpu = resources.device != "cpu" and bool(visible_gpu_count())  # gpu: auto on a CPU host is a CPU run
    need: HostNeed | None = None if checkpoint is None else host_need(checkpoint, largest_shard, on_gpu)
    rooms = {"available": available, "cgroup limit": limit, "cpu_memory_limit": resources.cpu_memory_limit}
    room_of, room = min(((k, v) for k, v in rooms.items() if v is not None), key=lambda kv: kv[1])
    imports = IMPORTS_RSS if on_gpu else CPU_IMPORTS_RSS
    return {
        "checkpoint_bytes": checkpoint,
        "load_peak_bytes": None if need is None else need.load_peak,
        "merge_peak_bytes": None if need is None else need.merge_peak,
        "available_bytes": available,
        "cgroup_limit_bytes": limit,
        "basis": "" if need is None else need.basis,
        "load_fits": None if checkpoint is None else imports + (largest_shard or checkpoint) <= room,
        "room_bytes": room,
        "room_of": room_of,
    }
