"""GPU memory samples through NVML (``pynvml``), with Xid events, and every rank's card under torchrun.
NVML ignores ``CUDA_VISIBLE_DEVICES``, so a device is mapped by ``contract.spec.bind_device`` as
the child maps it (rank N: the child's ``cuda:N``). Only ``pynvml.NVMLError`` is caught, so a bug is
not mistaken for a missing GPU. In a container with its own PID namespace the child shows as ``others``."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

import pynvml

from qlora_supervise.trainer_child.contract import spec

NVMLError = pynvml.NVMLError  # every NVML failure: each return code is a subclass of it
Handle = object  # NVML handles and event sets are opaque


class NvmlMemory(Protocol):
    total: int
    used: int
    free: int


class NvmlProcess(Protocol):
    pid: int
    usedGpuMemory: int | None


class NvmlEvent(Protocol):
    eventData: int


class NvmlUtilisation(Protocol):
    pid: int
    timeStamp: int  # microseconds
    smUtil: int  # percent of the SMs over the sample's period


class Nvml(Protocol):
    """The part of ``pynvml`` the monitor calls (tests pass a fake); each call may raise NVMLError."""

    nvmlEventTypeXidCriticalError: int

    def nvmlInit(self) -> None: ...
    def nvmlShutdown(self) -> None: ...
    def nvmlDeviceGetCount(self) -> int: ...
    def nvmlDeviceGetHandleByIndex(self, index: int) -> Handle: ...
    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> Handle: ...
    def nvmlDeviceGetUUID(self, handle: Handle) -> str | bytes: ...
    def nvmlDeviceGetIndex(self, handle: Handle) -> int: ...
    def nvmlDeviceGetMemoryInfo(self, handle: Handle, version: int = ...) -> NvmlMemory: ...
    def nvmlDeviceGetComputeRunningProcesses(self, handle: Handle) -> Iterable[NvmlProcess]: ...
    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: Handle) -> Iterable[NvmlProcess]: ...
    def nvmlDeviceGetProcessUtilization(self, handle: Handle, since: int) -> Iterable[NvmlUtilisation]: ...
    def nvmlEventSetCreate(self) -> Handle: ...
    def nvmlDeviceRegisterEvents(self, handle: Handle, event_types: int, event_set: Handle) -> None: ...
    def nvmlEventSetWait_v2(self, event_set: Handle, timeout_ms: int) -> NvmlEvent: ...
    def nvmlEventSetFree(self, event_set: Handle) -> None: ...


@dataclass(frozen=True)
class GpuSample:
    """One look at one GPU. Bytes throughout; ``time`` is wall-clock (``time.time()``)."""

    time: float
    gpu: int  # NVML (physical) index
    total: int
    used: int
    free: int
    this_process_bytes: int  # summed over the pids passed to sample() (the child's tree)
    others: tuple[tuple[int, int], ...]  # (pid, bytes) of every other process on the GPU
    xid_events: tuple[int, ...] = ()  # Xid codes seen since the previous sample
    # The other processes' SM utilisation (percent, summed, at most 100) since the previous sample;
    # None where NVML will not say (MIG, some containers).
    others_sm_util: int | None = None


class GpuProbe(Protocol):
    """NVML as the loop reads it (:class:`GpuMonitor`; tests pass a fake through the seams)."""

    def sample(self, pids: set[int]) -> GpuSample | None: ...
    def close(self) -> None: ...


class GpuMonitor:
    def __init__(self, nvml: Nvml, handle: Handle, index: int, events: Handle | None) -> None:
        self._nvml = nvml
        self._handle = handle
        self.index = index
        self._events = events
        self._util_seen = 0  # NVML's timestamp (microseconds) of the newest utilisation sample read

    @classmethod
    def open(cls, device: str, *, nvml: Nvml | None = None) -> GpuMonitor | None:
        """``device``'s monitor, or None without NVML, driver or GPU (or on ``cpu``); never raises or logs."""
        started = None if device == "cpu" else _started_nvml(nvml)
        if started is None:
            return None
        try:
            handle = _handle_for(started, device)
            index = int(started.nvmlDeviceGetIndex(handle))
        except (NVMLError, LookupError, spec.DeviceError):  # no such GPU, or none visible: nothing to watch
            _shutdown(started)
            return None
        return cls(started, handle, index, _xid_event_set(started, handle))

    def sample(self, pids: set[int]) -> GpuSample | None:
        """Memory now, split into ``pids`` (the child's tree) and the rest; None on an NVML error."""
        try:
            memory = _memory_info(self._nvml, self._handle)
            processes = _processes(self._nvml, self._handle)
        except NVMLError:  # the GPU fell off the bus, the driver reset, ...: no sample this tick
            return None
        mine = sum(used for pid, used in processes if pid in pids)
        others = tuple((pid, used) for pid, used in processes if pid not in pids)
        sizes = int(memory.total), int(memory.used), int(memory.free)
        xids, sm_util = self._drain_xids(), self._others_sm_util(pids)
        return GpuSample(time.time(), self.index, *sizes, mine, others, xids, sm_util)

    def _others_sm_util(self, pids: set[int]) -> int | None:
        """The other processes' SM utilisation since the previous call (each process's newest sample)."""
        try:
            samples = list(self._nvml.nvmlDeviceGetProcessUtilization(self._handle, self._util_seen))
        except NVMLError:  # NotFound: no sample since the last call; NotSupported: the board will not say
            return None
        newest: dict[int, tuple[int, int]] = {}
        for s in samples:
            self._util_seen = max(self._util_seen, int(s.timeStamp))
            if int(s.pid) not in pids and int(s.timeStamp) >= newest.get(int(s.pid), (-1, 0))[0]:
                newest[int(s.pid)] = (int(s.timeStamp), int(s.smUtil))
        return min(100, sum(util for _, util in newest.values()))

    def close(self) -> None:
        if self._events is not None:
            with contextlib.suppress(NVMLError):  # closing is best effort: the GPU may be gone
                self._nvml.nvmlEventSetFree(self._events)
            self._events = None
        _shutdown(self._nvml)

    def _drain_xids(self) -> tuple[int, ...]:
        if self._events is None:
            return ()
        found: list[int] = []
        for _ in range(64):  # bounded: a storm of events must not stall the loop's tick
            try:
                event = self._nvml.nvmlEventSetWait_v2(self._events, 0)
            except NVMLError:  # a timeout: no more events; else the GPU is lost (the memory sample says so)
                break
            found.append(int(event.eventData))
        return tuple(found)


def _started_nvml(nvml: Nvml | None) -> Nvml | None:
    started: Nvml = pynvml if nvml is None else nvml
    try:
        started.nvmlInit()
    except NVMLError:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: not a GPU host
        return None
    return started


def visible_gpu_count(*, nvml: Nvml | None = None) -> int | None:
    """How many GPUs the child could use: the ``CUDA_VISIBLE_DEVICES`` list when it is set, else
    NVML's count; None where NVML or the driver is missing (no GPU host: ranks run on the CPU)."""
    if (started := _started_nvml(nvml)) is None:
        return None
    try:
        count = int(started.nvmlDeviceGetCount())
    except NVMLError:
        return None
    finally:
        _shutdown(started)
    listed = spec.visible_entries(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return count if listed is None else min(count, len(listed))


def _handle_for(nvml: Nvml, device: str) -> Handle:
    """The handle of the GPU the child trains on (it inherits our ``CUDA_VISIBLE_DEVICES``)."""
    if (target := spec.bind_device(device, os.environ.get("CUDA_VISIBLE_DEVICES")).nvml_target) is None:
        raise LookupError(f"device {device!r}: no GPU visible")
    if isinstance(target, int):
        return nvml.nvmlDeviceGetHandleByIndex(target)
    with contextlib.suppress(NVMLError):  # NotFound / InvalidArgument: perhaps a prefix, below
        return nvml.nvmlDeviceGetHandleByUUID(target)
    # CUDA_VISIBLE_DEVICES accepts unique UUID prefixes; NVML wants the whole UUID.
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        found = nvml.nvmlDeviceGetUUID(handle)
        if (found.decode() if isinstance(found, bytes) else found).startswith(target):
            return handle
    raise LookupError(f"no GPU with UUID {target}")


def _memory_info(nvml: Nvml, handle: Handle) -> NvmlMemory:
    # v2 leaves driver-reserved memory out of `used`, which matches what processes can hold.
    version = getattr(nvml, "nvmlMemory_v2", None)
    if isinstance(version, int):
        # A driver older than the v2 struct answers FunctionNotFound / ArgumentVersionMismatch.
        with contextlib.suppress(NVMLError):
            return nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
    return nvml.nvmlDeviceGetMemoryInfo(handle)


def _processes(nvml: Nvml, handle: Handle) -> list[tuple[int, int]]:
    """(pid, bytes) per process, compute and graphics merged."""
    by_pid: dict[int, int] = {}
    for query in (nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetGraphicsRunningProcesses):
        try:
            listed = list(query(handle))
        except pynvml.NVMLError_NotSupported:  # e.g. graphics processes on a compute-only board
            continue
        for process in listed:
            used = process.usedGpuMemory  # None where the driver will not say (e.g. no permission)
            by_pid[int(process.pid)] = max(by_pid.get(int(process.pid), 0), int(used or 0))
    return sorted(by_pid.items())


def _xid_event_set(nvml: Nvml, handle: Handle) -> Handle | None:
    try:
        events = nvml.nvmlEventSetCreate()
    except NVMLError:
        return None
    try:
        nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
    except NVMLError:  # not supported on this board / driver, or not permitted
        with contextlib.suppress(NVMLError):
            nvml.nvmlEventSetFree(events)
        return None
    return events


def _shutdown(nvml: Nvml) -> None:
    with contextlib.suppress(NVMLError):  # Uninitialized, or the driver went away: nothing to release
        nvml.nvmlShutdown()


class RankCards:
    """One :class:`GpuMonitor` per local rank whose card NVML could open."""

    def __init__(self, monitors: Mapping[int, GpuMonitor]) -> None:
        self._monitors = dict(monitors)

    @classmethod
    def open(cls, knobs: spec.Knobs, device: str, *, nvml: Nvml | None = None) -> RankCards | None:
        """The cards of ``knobs``' ranks; None for a single process on the first card (a single one
        that ``drop_rank`` left is watched here), on the CPU, or when NVML opens no card."""
        if (knobs.world_size <= 1 and not knobs.gpus) or device == "cpu":
            return None
        cards = enumerate(spec.rank_gpus(knobs))
        opened = {rank: GpuMonitor.open(f"cuda:{position}", nvml=nvml) for rank, position in cards}
        monitors = {rank: monitor for rank, monitor in opened.items() if monitor is not None}
        return cls(monitors) if monitors else None

    @property
    def indexes(self) -> dict[int, int]:
        """Local rank -> the NVML (physical) index of its card."""
        return {rank: monitor.index for rank, monitor in self._monitors.items()}

    def sample(self, pids: set[int]) -> dict[int, GpuSample]:
        """One sample per card that answered, by local rank (``pids``: the child's whole tree)."""
        samples = {rank: monitor.sample(pids) for rank, monitor in self._monitors.items()}
        return {rank: sample for rank, sample in samples.items() if sample is not None}

    def close(self) -> None:
        for monitor in self._monitors.values():
            monitor.close()
        self._monitors.clear()
