"""GPU sampling through NVML: absent NVML gives None, a fake NVML exercises the sample logic."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import pynvml
import pytest

from qlora_supervise.supervisor.watching.gpu import GpuMonitor, GpuSample, visible_gpu_count

GIB = 1024**3
# The fake raises pynvml's own error classes, as the real bindings do (one subclass per return code).
NVMLError = pynvml.NVMLError


@dataclass
class _Proc:
    pid: int
    usedGpuMemory: int | None


@dataclass
class _Memory:
    total: int
    used: int
    free: int


@dataclass
class _Event:
    eventData: int


@dataclass
class _Util:
    pid: int
    timeStamp: int
    smUtil: int


@dataclass
class FakeNvml:
    """Four GPUs; GPU 2 holds our child (pids 100, 101) and another user's process (pid 900)."""

    init_error: Exception | None = None
    events_supported: bool = True
    graphics_supported: bool = True
    fail_memory: bool = False
    memory_error: Exception | None = None  # raised by the memory query instead (a bug, not NVML)
    xids: list[int] = field(default_factory=list)
    # Per-process utilisation samples NVML holds (None: the board does not support the query).
    utilisation: list[_Util] | None = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    nvmlEventTypeXidCriticalError: int = 8
    nvmlMemory_v2: int = 0x2000028

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return 4

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        if not 0 <= index < 4:
            raise pynvml.NVMLError_InvalidArgument()
        return index

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> int:
        for index in range(4):
            if self.nvmlDeviceGetUUID(index).decode() == uuid:
                return index
        raise pynvml.NVMLError_NotFound()

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return f"GPU-000{handle}aaaa-bbbb".encode()

    def nvmlDeviceGetIndex(self, handle: int) -> int:
        return handle

    def nvmlDeviceGetMemoryInfo(self, handle: int, version: int | None = None) -> _Memory:
        if self.memory_error is not None:
            raise self.memory_error
        if self.fail_memory:
            raise pynvml.NVMLError_GpuIsLost()
        return _Memory(total=80 * GIB, used=30 * GIB, free=50 * GIB)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[_Proc]:
        return [_Proc(100, 10 * GIB), _Proc(101, 2 * GIB), _Proc(900, 15 * GIB), _Proc(901, None)]

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[_Proc]:
        if not self.graphics_supported:
            raise pynvml.NVMLError_NotSupported()
        return [_Proc(900, 15 * GIB)]

    def nvmlDeviceGetProcessUtilization(self, handle: int, since: int) -> list[_Util]:
        if self.utilisation is None:
            raise pynvml.NVMLError_NotSupported()
        newer = [u for u in self.utilisation if u.timeStamp > since]
        if not newer:
            raise pynvml.NVMLError_NotFound()  # what NVML answers when no sample is newer
        return newer

    def nvmlEventSetCreate(self) -> str:
        return "events"

    def nvmlDeviceRegisterEvents(self, handle: int, kinds: int, events: str) -> None:
        if not self.events_supported:
            raise pynvml.NVMLError_NotSupported()

    def nvmlEventSetWait_v2(self, events: str, timeout_ms: int) -> _Event:
        if not self.xids:
            raise pynvml.NVMLError_Timeout()
        return _Event(self.xids.pop(0))

    def nvmlEventSetFree(self, events: str) -> None:
        self.calls.append("free")


def _open(device: str, nvml: FakeNvml) -> GpuMonitor:
    monitor = GpuMonitor.open(device, nvml=nvml)
    assert monitor is not None
    return monitor


def test_open_without_nvml_returns_none() -> None:
    """Where NVML or the driver is missing (as on this CPU machine) open() returns None, never raises."""
    monitor = GpuMonitor.open("auto")
    if monitor is not None:  # a machine with a GPU: the real sample must work instead
        sample = monitor.sample(set())
        monitor.close()
        assert sample is not None and sample.total > 0
        return
    import pynvml

    with pytest.raises(pynvml.NVMLError):
        pynvml.nvmlInit()


@pytest.mark.parametrize(
    "error",
    [
        pynvml.NVMLError_DriverNotLoaded(),
        pynvml.NVMLError_LibraryNotFound(),
        NVMLError(pynvml.NVML_ERROR_UNKNOWN),
    ],
)
def test_open_returns_none_when_init_fails(error: Exception) -> None:
    """An NVML init failure of any kind (any NVMLError subclass) means nothing to watch."""
    assert GpuMonitor.open("auto", nvml=FakeNvml(init_error=error)) is None
    assert visible_gpu_count(nvml=FakeNvml(init_error=error)) is None


def test_an_error_that_is_not_nvmls_is_not_taken_for_a_missing_gpu() -> None:
    """Errors are caught by class: a bug (a TypeError) in a query propagates, never read as "no GPU"."""
    with pytest.raises(TypeError, match="a bug"):
        GpuMonitor.open("auto", nvml=FakeNvml(init_error=TypeError("a bug")))
    monitor = _open("auto", FakeNvml(memory_error=TypeError("a bug")))
    with pytest.raises(TypeError, match="a bug"):
        monitor.sample({1})


def test_nvml_errors_are_one_class_per_return_code() -> None:
    """What the monitor catches is what pynvml raises: NVMLError(code) builds the code's subclass."""
    assert type(NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)) is pynvml.NVMLError_NotSupported
    assert issubclass(pynvml.NVMLError_Timeout, NVMLError) and issubclass(
        pynvml.NVMLError_GpuIsLost, NVMLError
    )


def test_open_cpu_device_returns_none_without_touching_nvml() -> None:
    """A CPU job has no GPU to watch."""
    nvml = FakeNvml()
    assert GpuMonitor.open("cpu", nvml=nvml) is None
    assert nvml.calls == []


@pytest.mark.parametrize(
    ("device", "visible", "index"),
    [
        ("auto", None, 0),
        ("cuda:3", None, 3),
        ("auto", "2,3", 2),
        ("cuda:1", "2,3", 3),
        ("GPU-0001aaaa-bbbb", "2,3", 1),
        ("auto", "GPU-0003", 3),  # CUDA accepts a unique UUID prefix; NVML needs the whole UUID
    ],
)
def test_device_resolution_follows_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch, device: str, visible: str | None, index: int
) -> None:
    """auto and cuda:N count within CUDA_VISIBLE_DEVICES; UUIDs and prefixes name one GPU."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert _open(device, FakeNvml()).index == index


@pytest.mark.parametrize(("device", "visible"), [("cuda:7", None), ("cuda:2", "0,1"), ("GPU-ffff", None)])
def test_open_unknown_gpu_returns_none_and_shuts_nvml_down(
    monkeypatch: pytest.MonkeyPatch, device: str, visible: str | None
) -> None:
    """A GPU the child could not see either gives None, and NVML is released."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    nvml = FakeNvml()
    assert GpuMonitor.open(device, nvml=nvml) is None
    assert nvml.calls == ["init", "shutdown"]


def test_sample_splits_the_childs_tree_from_other_processes(monkeypatch: pytest.MonkeyPatch) -> None:
    """this_process_bytes sums the given pids; every other pid is listed once; unknown usage is 0."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monitor = _open("cuda:2", FakeNvml())
    sample = monitor.sample({100, 101, 555})
    assert isinstance(sample, GpuSample)
    assert (sample.gpu, sample.total, sample.used, sample.free) == (2, 80 * GIB, 30 * GIB, 50 * GIB)
    assert sample.this_process_bytes == 12 * GIB
    assert sample.others == ((900, 15 * GIB), (901, 0))
    assert sample.xid_events == ()


def test_the_others_utilisation_is_each_others_newest_sample_since_the_last_look() -> None:
    """The other processes' SM utilisation sums each one's newest sample (ours left out), at most
    100; a look with no newer sample, or a board that will not say, gives None."""
    held = [_Util(900, 10, 30), _Util(900, 20, 50), _Util(901, 15, 70), _Util(100, 20, 99)]
    nvml = FakeNvml(utilisation=held)
    monitor = _open("auto", nvml)
    first, second = monitor.sample({100}), monitor.sample({100})
    assert first is not None and first.others_sm_util == 100  # 50 + 70, capped
    assert second is not None and second.others_sm_util is None  # nothing newer than 20
    held.append(_Util(900, 30, 20))
    third = monitor.sample({100})
    assert third is not None and third.others_sm_util == 20
    unsupported = _open("auto", FakeNvml(utilisation=None)).sample(set())
    assert unsupported is not None and unsupported.others_sm_util is None


def test_graphics_query_not_supported_is_not_an_error() -> None:
    """Compute-only boards refuse the graphics process query; samples still come."""
    sample = _open("auto", FakeNvml(graphics_supported=False)).sample(set())
    assert sample is not None and len(sample.others) == 4


def test_xid_events_are_drained_per_sample() -> None:
    """Xid codes seen since the previous sample come with the next one, once."""
    nvml = FakeNvml(xids=[79, 48])
    monitor = _open("auto", nvml)
    first, second = monitor.sample(set()), monitor.sample(set())
    assert first is not None and second is not None
    assert (first.xid_events, second.xid_events) == ((79, 48), ())


def test_xid_events_unsupported_are_ignored() -> None:
    """Without event support the monitor works and reports no Xids."""
    nvml = FakeNvml(events_supported=False, xids=[79])
    sample = _open("auto", nvml).sample(set())
    assert sample is not None and sample.xid_events == ()
    assert "free" in nvml.calls  # the event set that could not be registered is released


def test_sample_returns_none_when_nvml_fails() -> None:
    """An NVML error mid-run (GPU lost, driver reset) is a missing sample, not a crash of the loop."""
    assert _open("auto", FakeNvml(fail_memory=True)).sample({1}) is None


def test_close_releases_events_and_nvml() -> None:
    """close() frees the event set and shuts NVML down."""
    nvml = FakeNvml()
    _open("auto", nvml).close()
    assert nvml.calls == ["init", "free", "shutdown"]


def test_fake_matches_the_pynvml_names_used() -> None:
    """Every NVML name the monitor calls exists in the installed pynvml (so the fake is not lying)."""
    import pynvml

    used: list[Any] = [name for name in dir(FakeNvml) if name.startswith("nvml")]
    assert [name for name in used if not hasattr(pynvml, name)] == []


@pytest.mark.parametrize(
    ("device", "visible", "physical"),
    [
        ("cuda:1", "2,3", 3),  # the case that once sent the child to GPU 1 while GPU 3 was watched
        ("auto", "2,3", 2),
        ("cuda:2", None, 2),
        ("1", "0,3", 3),
    ],
)
def test_supervisor_watches_the_gpu_the_child_trains_on(
    monkeypatch: pytest.MonkeyPatch, device: str, visible: str | None, physical: int
) -> None:
    """Given the same inherited CUDA_VISIBLE_DEVICES, the child's GPU is the one NVML watches."""
    from qlora_supervise.trainer_child.__main__ import prepare_env
    from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DataSpec, Knobs, TrainSpec
    from qlora_supervise.trainer_child.run import memory

    for name in ("HF_HUB_OFFLINE", "TOKENIZERS_PARALLELISM", "ARROW_DEFAULT_MEMORY_POOL"):
        monkeypatch.setenv(name, os.environ.get(name, ""))  # restored after the test
    monkeypatch.setattr(memory, "tune_malloc", lambda arenas=2: None)  # leave this process's malloc alone
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    watched = _open(device, FakeNvml()).index  # the supervisor side, before the child changes anything

    spec = AttemptSpec(
        attempt=1, run_dir="r", knobs=Knobs(model="m"), data=DataSpec(path="d"), train=TrainSpec(),
        events_file="e", error_file="x", checkpoints_dir="c", adapter_dir="a", merged_dir="m", device=device,
    )  # fmt: skip
    prepare_env(spec)  # the child side: it inherits the same CUDA_VISIBLE_DEVICES
    child_visible = os.environ["CUDA_VISIBLE_DEVICES"]
    assert child_visible.split(",")[0] == str(physical), child_visible  # the child trains on its cuda:0
    assert watched == physical
