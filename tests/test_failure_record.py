"""The error report and the failure, each read once into typed records, old files included."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from qlora_supervise.policies import decide as policy
from qlora_supervise.supervisor.diagnosis.classify import classify_exit
from qlora_supervise.supervisor.facts.failure import ChildExit, Failure, XidFacts
from qlora_supervise.supervisor.loop.outcome import AttemptOutcome, failure_record, record_of
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.record.journal import (
    AttemptPeakSource,
    AttemptRecord,
    Outcome,
    Phase,
    read_attempts,
)
from qlora_supervise.supervisor.watching.watch import Progress, Watched
from qlora_supervise.trainer_child.contract.allocator import AllocatorPeak
from qlora_supervise.trainer_child.contract.codes import ExitCode, FailureKind, Stage
from qlora_supervise.trainer_child.contract.oom_message import OomNumbers
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import Knobs

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"
#: An error report written by the child of 2026-11-29 (H200, 8 GiB cap), before OomNumbers existed.
OLD_REPORT = RESULTS / "gpu-h200-2026-11-29" / "cap-8GiB" / "attempt-001-error.json"

#: A gpu_fault line as the journal wrote it before the failure was one record (FailureRecord's
#: to_json, the Xid facts inside ``numbers``).
OLD_GPU_FAULT_LINE = json.dumps(
    {
        "version": 2, "attempt": 3, "phase": "train", "outcome": "failed", "knobs": {"model": "/m/7b"},
        "started_at": 1795944000.0, "ended_at": 1795944042.5, "exit_code": 1, "signal": None,
        "resumed_from": 10, "steps_completed": 12, "next_resume_from": None, "lost_steps": 0,
        "peak": {"bytes": 12884901888, "source": "heartbeat"},
        "failure": {
            "kind": "gpu_fault", "stage": "forward", "numbers": {"xid": [13, 79], "fatal_xid": 79},
            "evidence": "NVML: Xid 13 (...), Xid 79 (GPU has fallen off the bus, fatal) during the attempt",
            "message": "RuntimeError: CUDA error: unspecified launch failure",
            "emergency_checkpoint": None, "expandable_segments_active": True, "rank": None,
            "local_rank": None,
        },
        "decision": {"action": "give_up", "why": "the GPU reported fatal Xid 79", "retryable": False},
        "plan": None, "optimizer_reset": None,
    }
)  # fmt: skip


def _old_report() -> tuple[ErrorReport, dict[str, Any]]:
    text = OLD_REPORT.read_text(encoding="utf-8")
    return ErrorReport.from_json(text), json.loads(text)


def test_an_old_error_json_reads_its_oom_numbers_and_allocator_peak_typed() -> None:
    """The 2026-11-29 report's oom_numbers become OomNumbers and its memory_stats an AllocatorPeak."""
    report, raw = _old_report()
    numbers = report.oom_numbers
    assert isinstance(numbers, OomNumbers) and numbers.to_json() == raw["oom_numbers"]
    assert (numbers.allowed, numbers.tried_to_allocate, numbers.total_capacity) == (
        8 << 30,
        360710144,
        150109106995,
    )
    assert numbers.reserved_total is None and numbers.processes == {}  # not printed by that wording
    assert numbers.step_need_bytes == 7816840479 + 360710144
    stats = raw["memory_stats"]
    assert report.allocator_peak == AllocatorPeak(
        stats["allocated_bytes.all.peak"], stats["reserved_bytes.all.peak"]
    )


def test_the_report_file_keeps_its_shape() -> None:
    """Written again, the report holds the same oom_numbers and the whole memory_stats; the derived peak
    is not written, and the file reads back equal."""
    report, raw = _old_report()
    again = json.loads(report.to_json())
    assert again["oom_numbers"] == raw["oom_numbers"] and again["memory_stats"] == raw["memory_stats"]
    assert "allocator_peak" not in again and set(raw) <= set(again)
    assert ErrorReport.from_json(report.to_json()) == report


def test_a_report_without_numbers_reads_and_one_with_ill_typed_ones_is_refused() -> None:
    """A report without oom_numbers or memory_stats reads; hand-edited ill-typed values raise ValueError."""
    base = {"exit_code": 70, "exception_type": "OutOfMemoryError", "message": "CUDA out of memory",
            "traceback": "", "stage": "forward", "step": 2, "is_oom": True}  # fmt: skip
    bare = ErrorReport.from_json(json.dumps(base))
    assert bare.oom_numbers == OomNumbers() and bare.allocator_peak is None
    assert bare.oom_numbers.step_need_bytes is None
    odd = {**base, "oom_numbers": {"free": "lots", "allowed": True, "tried_to_allocate": 5,
                                    "processes": {"123": 7, "x": 1, "9": "big"}},
           "memory_stats": {"allocated_bytes.all.peak": "9"}}  # fmt: skip
    with pytest.raises(ValueError):
        ErrorReport.from_json(json.dumps(odd))
    with pytest.raises(ValueError):
        ErrorReport.from_json(json.dumps({**base, "oom_numbers": "none"}))


def test_the_attempts_peak_comes_from_the_typed_report() -> None:
    """record_of takes the failed step's peak from the report's typed numbers: the larger of the
    allocator's peak and what the OOM message says the step needed."""
    report, raw = _old_report()
    outcome = AttemptOutcome(
        number=1, plan=Plan(Phase.TRAIN, Knobs(model="/m")), exit=ChildExit(int(ExitCode.OOM)),
        progress=Progress(step=0, peak_bytes=1 << 30), report=report,
        memory=Watched(Progress(), gpu_peak_process=9 << 30),
        resumed_from=0, started_at=0.0, ended_at=1.0, log_tail="",
    )  # fmt: skip
    peak = record_of(outcome, Outcome.FAILED, 0).peak
    need = raw["oom_numbers"]["already_allocated"] + raw["oom_numbers"]["tried_to_allocate"]
    best = max(need, raw["memory_stats"]["allocated_bytes.all.peak"])
    source = AttemptPeakSource.OOM_MESSAGE if best == need else AttemptPeakSource.ALLOCATOR_REPORT
    assert peak is not None and (peak.bytes, peak.source) == (best, source)


def test_the_classifier_reads_the_reports_typed_numbers() -> None:
    """An OOM report's numbers reach the failure as the message printed them, derived values added."""
    report, raw = _old_report()
    failure = classify_exit(ChildExit(int(ExitCode.OOM)), report, "")
    assert failure.kind.is_oom and raw["oom_numbers"].items() <= dict(failure.numbers).items()
    assert "others_in_use" in failure.numbers  # derived from them, as before


def test_a_journal_line_written_before_reads_into_the_one_failure_record(tmp_path: Path) -> None:
    """An old gpu_fault line reads into Failure with its Xid facts typed, and writes back the same object."""
    raw = json.loads(OLD_GPU_FAULT_LINE)
    record = AttemptRecord.from_json(raw)
    failure = record.failure
    assert (
        isinstance(failure, Failure)
        and failure.kind is FailureKind.GPU_FAULT
        and failure.stage is Stage.FORWARD
    )
    assert failure.xid == XidFacts((13, 79), 79) and failure.fatal_xid == 79 and failure.numbers == {}
    assert failure.expandable_segments_active is True and failure.emergency_checkpoint is None
    assert failure.to_json() == raw["failure"]
    assert json.loads(record.to_line())["failure"] == raw["failure"]
    journal = tmp_path / "attempts.jsonl"
    journal.write_text(OLD_GPU_FAULT_LINE + "\n")
    records, bad = read_attempts(journal)
    assert bad == 0 and records[0].failure == failure
    decision = policy.decide(failure, Knobs(model="/m/7b"), [], policy.Settings())
    assert isinstance(decision, policy.GiveUp) and "fatal Xid 79" in decision.why


@pytest.mark.parametrize("journal", sorted(RESULTS.rglob("attempts.jsonl")), ids=lambda p: str(p.parent.name))
def test_every_recorded_journal_keeps_its_failure_objects(journal: Path) -> None:
    """The journals of the recorded runs read into Failure records that write back the same objects."""
    lines = [json.loads(line) for line in journal.read_text(encoding="utf-8").splitlines() if line.strip()]
    records, bad = read_attempts(journal)
    assert bad == 0 and len(records) == len(lines)
    for raw, record in zip(lines, records, strict=True):
        if raw.get("failure"):
            assert record.failure is not None
            written = record.failure.to_json()
            # Lines from before torchrun lack the ranks: they come back as None, all else as it was.
            assert {k: v for k, v in written.items() if k in raw["failure"]} == raw["failure"]
            assert all(written[k] is None for k in written.keys() - raw["failure"].keys())


def test_the_journals_failure_adds_the_reports_facts_and_keeps_the_xid() -> None:
    """failure_record puts the report's emergency checkpoint on the classified failure, Xid facts kept."""
    report, _ = _old_report()
    fault = Failure(FailureKind.GPU_FAULT, Stage.FORWARD, {}, "nvml", "x" * 3000, xid=XidFacts((48,), 48))
    kept = failure_record(fault, report)
    assert kept.xid == fault.xid and len(kept.message) == 2000
    assert kept.expandable_segments_active is report.expandable_segments_active
    assert Failure.from_json(kept.to_json()) == kept
    assert kept.to_json()["numbers"] == {"xid": [48], "fatal_xid": 48}
