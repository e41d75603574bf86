"""The contract between supervisor and child: typed records that round-trip through JSON."""

from __future__ import annotations

import json
import re

import pytest

from qlora_supervise.trainer_child.contract.codes import ExitCode, Stage
from qlora_supervise.trainer_child.contract.events import (
    ChildPeakSource,
    Heartbeat,
    MemoryNumbers,
    parse_event,
)
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import DeviceBinding, DeviceError, bind_device


def _report(stage: object) -> ErrorReport:
    return ErrorReport(
        exit_code=int(ExitCode.OOM),
        exception_type="OutOfMemoryError",
        message="CUDA out of memory",
        traceback="",
        stage=stage,  # type: ignore[arg-type]  # what a JSON file holds: a plain string
        step=3,
        is_oom=True,
    )


def test_error_report_stage_reads_back_as_a_stage() -> None:
    """A report's stage survives the JSON round trip as a Stage, written as its plain name."""
    report = _report(Stage.BACKWARD)
    text = report.to_json()
    assert json.loads(text)["stage"] == "backward"
    back = ErrorReport.from_json(text)
    assert back.stage is Stage.BACKWARD
    assert back == report


def test_error_report_with_an_unknown_stage_reads_as_unknown() -> None:
    """A stage name this version does not know (a newer child, a hand edit) is Stage.UNKNOWN."""
    raw = json.loads(_report(Stage.LOAD).to_json())
    raw["stage"] = "warp_drive"
    assert ErrorReport.from_json(json.dumps(raw)).stage is Stage.UNKNOWN
    assert _report("forward").stage is Stage.FORWARD


def test_peak_rule_prefers_the_cuda_allocator_then_the_data_segment() -> None:
    """The child picks the one peak: CUDA allocator on a GPU, else the data segment, else VmHWM."""
    gpu = MemoryNumbers.measured(cuda_peak=7, data_segment_peak=5, rss_high_water=3)
    cpu = MemoryNumbers.measured(cuda_peak=None, data_segment_peak=5, rss_high_water=3)
    bare = MemoryNumbers.measured(cuda_peak=None, data_segment_peak=None, rss_high_water=3)
    assert (gpu.peak_bytes, gpu.peak_source) == (7, ChildPeakSource.CUDA_ALLOCATOR)
    assert (cpu.peak_bytes, cpu.peak_source) == (5, ChildPeakSource.DATA_SEGMENT)
    assert (bare.peak_bytes, bare.peak_source) == (3, ChildPeakSource.RSS)


def test_heartbeat_round_trips_through_an_event_line() -> None:
    """A heartbeat written as an event line reads back equal, with flat jq-readable keys."""
    memory = MemoryNumbers.measured(
        cuda_peak=4096, data_segment_peak=900, rss_high_water=800, allocated=1024, reserved=2048, rss=700
    )
    beat = Heartbeat(Stage.FORWARD, 12, loss=1.5, tokens_per_s=250.0, memory=memory)
    line = json.loads(beat.to_line())
    assert line["event"] == "heartbeat" and line["peak_bytes"] == 4096 and line["stage"] == "forward"
    assert line["peak_source"] == "cuda_allocator" and line["allocated_bytes"] == 1024
    assert "peak" not in line and "peak_vmdata" not in line  # the peak is named once
    assert parse_event(line) == beat


def test_heartbeat_without_an_integer_step_is_not_trusted() -> None:
    """A line whose step is missing or not an integer gives no heartbeat."""
    assert parse_event({"event": "heartbeat", "stage": "forward"}) is None
    assert parse_event({"event": "heartbeat", "step": "3"}) is None
    assert parse_event({"event": "heartbeat", "step": True}) is None


@pytest.mark.parametrize(
    ("device", "visible", "child", "nvml"),
    [
        ("cpu", "2,3", "", None),
        ("auto", None, "0", 0),
        ("auto", "2,3", "2", 2),
        ("auto", "", "", None),  # nothing visible: an auto job trains on the CPU
        ("cuda:1", "2,3", "3", 3),
        ("1", "2,3", "3", 3),
        ("cuda:3", None, "3", 3),
        ("cuda:0", "GPU-abcd,GPU-ef01", "GPU-abcd", "GPU-abcd"),
        ("cuda:1", "4, 5", "5", 5),
        ("cuda:0", "1,-1,2", "1", 1),
        ("GPU-0001aaaa-bbbb", "2,3", "GPU-0001aaaa-bbbb", "GPU-0001aaaa-bbbb"),
        ("MIG-1234-5678", None, "MIG-1234-5678", "MIG-1234-5678"),
    ],
)
def test_bind_device_maps_the_job_device_through_cuda_visible_devices(
    device: str, visible: str | None, child: str, nvml: int | str | None
) -> None:
    """cuda:N is the N-th visible GPU for both sides; UUIDs name one GPU; cpu hides them all."""
    assert bind_device(device, visible) == DeviceBinding(child, nvml)


@pytest.mark.parametrize(
    ("device", "visible", "words"),
    [
        ("cuda:2", "2,3", "makes 2 GPU(s) visible"),
        ("cuda:1", "0,-1,2", "makes 1 GPU(s) visible"),  # CUDA stops reading the list at -1
        ("cuda:0", "", "makes 0 GPU(s) visible"),
        ("gpu0", None, "use auto, cpu"),
    ],
)
def test_bind_device_refuses_a_gpu_that_is_not_visible(device: str, visible: str | None, words: str) -> None:
    """An index past the visible list, or an unknown form, is a DeviceError saying what to use."""
    with pytest.raises(DeviceError, match=re.escape(words)):
        bind_device(device, visible)
