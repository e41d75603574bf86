"""GPU memory samples through NVML (``pynvml``, package ``nvidia-ml-py``), with Xid events.

``GpuMonitor.open(device)`` returns None where there is nothing to watch (no NVML library, no
driver, no such GPU, or ``device == "cpu"``); it never raises and logs nothing itself, so the
loop decides what to say. The loop replaces ``GpuMonitor.open`` in tests (a seam).

Device names are the job's: ``auto``, ``cuda:N`` or a UUID. NVML numbers GPUs physically and
ignores ``CUDA_VISIBLE_DEVICES``, so the device is mapped through that variable by
``contract.devices.bind_device``, the same function the child uses to pick its GPU. CUDA's default order
(fastest first) equals NVML's PCI order on machines with one GPU model; set
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` on mixed machines.

Caveat: NVML reports host PIDs. Inside a container with its own PID namespace the child's PID
does not match, so its memory shows up under ``others`` and ``this_process_bytes`` stays 0.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from qlora_supervise.trainer_child.contract.devices import bind_device, visible_entries


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


class GpuProbe(Protocol):
    """NVML as the loop reads it: the child's tree, the card's total and free, other processes.

    :class:`GpuMonitor` is the real one; tests pass a fake through the loop's seams.
    """

    def sample(self, pids: set[int]) -> GpuSample | None: ...

    def close(self) -> None: ...


class GpuMonitor:
    """An open NVML handle on one GPU. Use :meth:`open`; call :meth:`close` when done."""

    def __init__(self, nvml: Any, handle: Any, index: int, events: Any | None) -> None:
        self._nvml = nvml
        self._handle = handle
        self.index = index
        self._events = events

    @classmethod
    def open(cls, device: str, *, nvml: Any | None = None) -> GpuMonitor | None:
        """A monitor for ``device``, or None when NVML, the driver or the GPU is missing.

        ``nvml`` replaces the ``pynvml`` module (tests pass a fake).
        """
        if device == "cpu":
            return None
        nvml = _started_nvml(nvml)
        if nvml is None:
            return None
        try:
            handle = _handle_for(nvml, device)
            index = int(nvml.nvmlDeviceGetIndex(handle))
        except Exception:  # no such GPU (or not one NVML can see, or none visible): nothing to watch
            _shutdown(nvml)
            return None
        return cls(nvml, handle, index, _xid_event_set(nvml, handle))

    def sample(self, pids: set[int]) -> GpuSample | None:
        """Memory now, split into ``pids`` (the child's tree) and everyone else. None on an NVML error."""
        nvml = self._nvml
        try:
            memory = _memory_info(nvml, self._handle)
            processes = _processes(nvml, self._handle)
        except Exception:  # the GPU fell off the bus, the driver reset, ...: no sample this tick
            return None
        mine = sum(used for pid, used in processes if pid in pids)
        others = tuple((pid, used) for pid, used in processes if pid not in pids)
        return GpuSample(
            time=time.time(),
            gpu=self.index,
            total=int(memory.total),
            used=int(memory.used),
            free=int(memory.free),
            this_process_bytes=mine,
            others=others,
            xid_events=self._drain_xids(),
        )

    def close(self) -> None:
        if self._events is not None:
            with contextlib.suppress(Exception):  # closing is best effort
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
            except Exception:  # NVML_ERROR_TIMEOUT: no more events (or events broke: stop asking)
                break
            found.append(int(event.eventData))
        return tuple(found)


def _started_nvml(nvml: Any | None) -> Any | None:
    """``nvml`` (default: ``pynvml``) initialised; None where NVML or the driver is missing."""
    if nvml is None:
        nvml = _import_pynvml()
        if nvml is None:
            return None
    try:
        nvml.nvmlInit()
    except Exception:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...: not a GPU host
        return None
    return nvml


def visible_gpu_count(*, nvml: Any | None = None) -> int | None:
    """How many GPUs the child could use: the ``CUDA_VISIBLE_DEVICES`` list when it is set, else
    NVML's count; None where NVML or the driver is missing (no GPU host: ranks run on the CPU)."""
    nvml = _started_nvml(nvml)
    if nvml is None:
        return None
    try:
        count = int(nvml.nvmlDeviceGetCount())
    except Exception:
        return None
    finally:
        _shutdown(nvml)
    listed = visible_entries(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return count if listed is None else min(count, len(listed))


def _import_pynvml() -> Any | None:
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def _handle_for(nvml: Any, device: str) -> Any:
    """The NVML handle of the GPU the child trains on for ``device``.

    The child inherits this process's environment, so both read the same
    ``CUDA_VISIBLE_DEVICES``. Raises (DeviceError, LookupError) when there is no such GPU.
    """
    target = bind_device(device, os.environ.get("CUDA_VISIBLE_DEVICES")).nvml_target
    if target is None:
        raise LookupError(f"device {device!r}: no GPU visible")
    if isinstance(target, int):
        return nvml.nvmlDeviceGetHandleByIndex(target)
    return _handle_by_uuid(nvml, target)


def _handle_by_uuid(nvml: Any, uuid: str) -> Any:
    try:
        return nvml.nvmlDeviceGetHandleByUUID(uuid)
    except Exception:
        pass
    # CUDA_VISIBLE_DEVICES accepts unique UUID prefixes; NVML wants the whole UUID.
    for index in range(int(nvml.nvmlDeviceGetCount())):
        handle = nvml.nvmlDeviceGetHandleByIndex(index)
        if _text(nvml.nvmlDeviceGetUUID(handle)).startswith(uuid):
            return handle
    raise LookupError(f"no GPU with UUID {uuid}")


def _memory_info(nvml: Any, handle: Any) -> Any:
    # v2 leaves driver-reserved memory out of `used`, which matches what processes can hold.
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            return nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
        except Exception:
            pass
    return nvml.nvmlDeviceGetMemoryInfo(handle)


def _processes(nvml: Any, handle: Any) -> list[tuple[int, int]]:
    """(pid, bytes) per process, compute and graphics merged (a process can be in both)."""
    by_pid: dict[int, int] = {}
    for query in (nvml.nvmlDeviceGetComputeRunningProcesses, nvml.nvmlDeviceGetGraphicsRunningProcesses):
        for process in _listed(query, handle):
            used = process.usedGpuMemory  # None where the driver will not say (e.g. no permission)
            by_pid[int(process.pid)] = max(by_pid.get(int(process.pid), 0), int(used or 0))
    return sorted(by_pid.items())


def _listed(query: Any, handle: Any) -> Iterable[Any]:
    try:
        return list(query(handle))
    except Exception as error:
        if type(error).__name__ == "NVMLError_NotSupported":
            return []  # e.g. graphics processes on a compute-only board
        raise


def _xid_event_set(nvml: Any, handle: Any) -> Any | None:
    """An event set registered for Xid critical errors, or None where NVML does not offer them."""
    try:
        events = nvml.nvmlEventSetCreate()
    except Exception:
        return None
    try:
        nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, events)
    except Exception:  # not supported on this board / driver, or not permitted
        with contextlib.suppress(Exception):
            nvml.nvmlEventSetFree(events)
        return None
    return events


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _shutdown(nvml: Any) -> None:
    with contextlib.suppress(Exception):  # shutting down is best effort
        nvml.nvmlShutdown()
