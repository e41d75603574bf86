"""Host memory: psutil samples of the RAM, swap and the child tree's RSS, and the cgroup's limit and
OOM-kill counter (v2 ``memory.events``, v1 ``memory.oom_control``; the child runs in our cgroup;
``QLORA_SUPERVISE_CGROUP_MEMORY_EVENTS`` names a file to read instead)."""

from __future__ import annotations

import contextlib
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import psutil


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
    rss = 0 if pid is None else tree_rss(pid)
    return HostSample(time.time(), int(memory.total), int(memory.available), rss, swap_used)


def tree_rss(pid: int) -> int:
    """Resident bytes of ``pid`` and all its descendants; processes that vanish midway count 0."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.Error:  # NoSuchProcess, AccessDenied, ZombieProcess
        return 0
    total = 0
    for process in processes:
        with contextlib.suppress(psutil.Error):
            total += int(process.memory_info().rss)
    return total


def host_room() -> tuple[int, int | None]:
    """(RAM available now, the cgroup's memory limit or None): what the host budget starts from."""
    return int(psutil.virtual_memory().available), memory_limit_bytes()


ENV_MEMORY_EVENTS = "QLORA_SUPERVISE_CGROUP_MEMORY_EVENTS"
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
PROC_SELF_MOUNTINFO = Path("/proc/self/mountinfo")
_COUNTERS = (("cgroup2", "", "memory.events"), ("cgroup", "memory", "memory.oom_control"))  # v2 first


def oom_kill_count(path_override: Path | None = None) -> int | None:
    """The cgroup's ``oom_kill`` count (from ``path_override``, the variable, or our cgroup), or None."""
    value = os.environ.get(ENV_MEMORY_EVENTS, "").strip()
    path = path_override or (Path(value) if value else None) or memory_events_path()
    return None if path is None else read_oom_kill(path)


def read_oom_kill(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":  # exact key: v2 also has oom_group_kill
            return int(value) if value.strip().isdigit() else None
    return None


def memory_events_path(
    proc_cgroup: Path = PROC_SELF_CGROUP, mountinfo: Path = PROC_SELF_MOUNTINFO
) -> Path | None:
    """The counter file of this process's cgroup: v2 ``memory.events`` first, then v1."""
    try:
        cgroup_lines = proc_cgroup.read_text(encoding="utf-8").splitlines()
        mount_lines = mountinfo.read_text(encoding="utf-8").splitlines()
    except OSError:
        return None
    memberships = _memberships(cgroup_lines)
    for fstype, controller, filename in _COUNTERS:
        group, mount = memberships.get(controller), _mount(mount_lines, fstype, controller)
        found = _find_in(mount, group, filename) if group is not None and mount is not None else None
        if found is not None:
            return found
    return None


def memory_limit_bytes() -> int | None:
    """The limit beside the ``oom_kill`` counter (v2 ``memory.max``, v1 ``memory.limit_in_bytes``);
    None without one or when nothing can be read."""
    if (path := memory_events_path()) is None:
        return None
    for name in ("memory.max", "memory.limit_in_bytes"):
        try:
            text = (path.parent / name).read_text(encoding="ascii").strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:  # v1 reports "no limit" as ~2**63
            return int(text)
        return None
    return None


def _memberships(lines: list[str]) -> dict[str, str]:
    """Controller -> cgroup path (``""`` is the v2 hierarchy)."""
    found: dict[str, str] = {}
    for hierarchy, controllers, path in (line.split(":", 2) for line in lines if line.count(":") >= 2):
        if hierarchy == "0" and controllers == "":
            found[""] = path
        found.update({controller: path for controller in controllers.split(",") if controller})
    return found


def _mount(lines: list[str], fstype: str, controller: str) -> tuple[str, Path] | None:
    """The cgroup path the mount point shows as its top, and the mount point."""
    for line in lines:
        head, sep, tail = line.partition(" - ")
        fields, tail_fields = head.split(), tail.split()
        if not sep or len(fields) < 5 or not tail_fields or tail_fields[0] != fstype:
            continue
        options = tail_fields[2].split(",") if len(tail_fields) > 2 else []
        if not controller or controller in options:
            return _unescape(fields[3]), Path(_unescape(fields[4]))
    return None


def _find_in(mount: tuple[str, Path], group: str, filename: str) -> Path | None:
    """Our cgroup's file under the mount; else the nearest ancestor's (it counts descendants)."""
    root, point = mount
    candidate = point / (group[len(root) :] if group.startswith(root) else group).lstrip("/")
    while True:
        if (candidate / filename).is_file():
            return candidate / filename
        if candidate == point or point not in candidate.parents:
            return None
        candidate = candidate.parent


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as octal (``\040``).
    return re.sub(r"\\([0-7]{3})", lambda code: chr(int(code.group(1), 8)), field)
