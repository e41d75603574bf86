"""Host memory samples through psutil: the machine's RAM and swap, and the child tree's RSS."""

from __future__ import annotations

import time
from dataclasses import dataclass

import psutil

from qlora_supervise.supervisor.watching.cgroup import memory_limit_bytes


@dataclass(frozen=True)
class HostSample:
    """One look at the host. Bytes throughout; ``time`` is wall-clock (``time.time()``)."""

    time: float
    total: int
    available: int
    child_rss_bytes: int  # summed over the process and its descendants; 0 when gone or no pid
    swap_used: int


def sample_host(pid: int | None) -> HostSample:
    """Host memory now, and the RSS of ``pid``'s tree. A vanished process counts 0, never raises."""
    memory = psutil.virtual_memory()
    try:
        swap_used = int(psutil.swap_memory().used)
    except (OSError, RuntimeError):  # no /proc/swaps in some sandboxes
        swap_used = 0
    return HostSample(
        time=time.time(),
        total=int(memory.total),
        available=int(memory.available),
        child_rss_bytes=0 if pid is None else tree_rss(pid),
        swap_used=swap_used,
    )


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants; processes that vanish midway count 0."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:  # NoSuchProcess, AccessDenied, ZombieProcess
        return 0
    return sum(_rss(process) for process in processes)


def _rss(process: psutil.Process) -> int:
    try:
        return int(process.memory_info().rss)
    except psutil.Error:
        return 0


def host_room() -> tuple[int, int | None]:
    """(RAM available now, the cgroup's memory limit or None): what the host budget starts from."""
    return int(psutil.virtual_memory().available), memory_limit_bytes()
