"""Fragmentation judged from the allocator's facts and the step's fit, on recorded H200 reports."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from qlora_supervise.policies.memory_model import ModelShape
from qlora_supervise.supervisor.diagnosis.classify import classify_exit
from qlora_supervise.supervisor.diagnosis.fragmentation import StepFit, judge, predicted_fit
from qlora_supervise.supervisor.facts.failure import ChildExit
from qlora_supervise.trainer_child.contract.allocator import AllocatorFacts, facts_from_allocator
from qlora_supervise.trainer_child.contract.codes import ExitCode, FailureKind, Stage
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import Knobs

MIB, GIB = 1024**2, 1024**3
RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "gpu-h200-2026-11-29"
FIXTURES = Path(__file__).with_name("fixtures")
EXITED_OOM = ChildExit(returncode=int(ExitCode.OOM))
CAP = 8 * GIB


def _recorded(name: str) -> ErrorReport:
    return ErrorReport.from_json((RESULTS / name).read_text())


def _shape_7b() -> ModelShape:
    shape = ModelShape.from_config(
        {
            "model_type": "llama",
            **_config(json.loads((FIXTURES / "memory_points_h200.json").read_text())["shapes"]["7b-32k"]),
        }
    )
    assert shape is not None
    return shape


def _config(shape: dict[str, int]) -> dict[str, int]:
    return {
        "hidden_size": shape["hidden"],
        "num_hidden_layers": shape["layers"],
        "num_attention_heads": shape["heads"],
        "num_key_value_heads": shape["kv_heads"],
        "intermediate_size": shape["intermediate"],
        "vocab_size": shape["vocab"],
    }


def _knobs(micro: int, checkpointing: bool) -> Knobs:
    return Knobs(model="7b", micro_batch_size=micro, grad_accum=16 // micro, max_seq_len=2048,
                 gradient_checkpointing=checkpointing)  # fmt: skip


def _facts_from_message(report: ErrorReport) -> AllocatorFacts:
    """The recorded report predates the facts: its message's numbers at the OOM stand in, and the
    largest free block is taken as too small (the case most in favour of fragmentation)."""
    n = report.oom_numbers
    unallocated = n.reserved_unallocated
    return AllocatorFacts(
        requested_bytes=n.tried_to_allocate,
        allocated_bytes=n.already_allocated,
        reserved_bytes=n.already_allocated + unallocated,
        free_in_segments_bytes=unallocated,
        inactive_split_bytes=unallocated,
        largest_free_block_bytes=n.tried_to_allocate // 2,
        block_for_request=False,
        segments=40,
        limit_bytes=n.allowed,
        device_free_bytes=n.free,
    )


def test_forward_oom_at_a_nearly_full_cap_is_capacity_not_fragmentation() -> None:
    """The H200's 8 GiB forward OOM (0.93 GiB split free, 344 MiB asked) is oom_forward: it needs ~11 GiB."""
    report = _recorded("after-fix/cap-8GiB/attempt-002-error.json")
    fit = predicted_fit(_shape_7b(), _knobs(4, checkpointing=True), CAP)
    assert fit is not None and fit.peak_bytes > 10 * GIB and not fit.fits
    with_facts = dataclasses.replace(report, allocator=_facts_from_message(report))
    failure = classify_exit(EXITED_OOM, with_facts, "", fit=fit)
    assert (failure.kind, failure.stage) == (FailureKind.OOM_FORWARD, Stage.FORWARD)
    assert "capacity" in failure.evidence and "does not fit" in failure.evidence
    assert failure.numbers["step_peak"] == fit.peak_bytes and failure.numbers["step_budget"] == CAP
    # The report exactly as recorded (no facts): the model's prediction alone vetoes the message rule,
    assert classify_exit(EXITED_OOM, report, "", fit=fit).kind is FailureKind.OOM_FORWARD
    # which without it called this fragmentation (and cost an expandable_segments attempt on the H200).
    assert classify_exit(EXITED_OOM, report, "").kind is FailureKind.OOM_FRAGMENTATION


def test_every_recorded_capped_oom_is_capacity_with_the_model() -> None:
    """All eight recorded H200 OOMs (8 and 16 GiB caps) come out the stage's OOM from facts and the model."""
    knobs_of = {  # the attempts' knobs, from their attempts.jsonl
        "after-fix/cap-8GiB/attempt-001-error.json": _knobs(4, False),
        "after-fix/cap-8GiB/attempt-002-error.json": _knobs(4, True),
        "after-fix/cap-8GiB/attempt-003-error.json": _knobs(4, True),
        "after-fix/cap-8GiB/attempt-004-error.json": _knobs(2, True),
        "cap-8GiB/attempt-001-error.json": _knobs(4, False),
        "cap-8GiB/attempt-002-error.json": _knobs(4, False),
        "cap-8GiB/attempt-003-error.json": _knobs(4, True),
        "cap-16GiB/attempt-001-error.json": _knobs(4, False),
    }
    for name, knobs in knobs_of.items():
        report = _recorded(name)
        fit = predicted_fit(_shape_7b(), knobs, report.oom_numbers.allowed)
        failure = classify_exit(
            EXITED_OOM, dataclasses.replace(report, allocator=_facts_from_message(report)), "", fit=fit
        )
        assert failure.kind in (FailureKind.OOM_FORWARD, FailureKind.OOM_BACKWARD), (name, failure.evidence)


def test_fragmentation_verdict_comes_with_the_numbers_that_show_the_step_fits() -> None:
    """Split free memory covers the request, no block of its size, a same-shape step done: fragmentation."""
    report = _recorded("after-fix/cap-8GiB/attempt-002-error.json")
    facts = dataclasses.replace(_facts_from_message(report), same_shape_step=3, same_shape_peak_bytes=7 * GIB)
    failure = classify_exit(EXITED_OOM, dataclasses.replace(report, allocator=facts), "")
    assert failure.kind is FailureKind.OOM_FRAGMENTATION and failure.stage is Stage.FORWARD
    assert "step 3 with this micro-batch shape completed" in failure.evidence
    assert failure.numbers["allocator_largest_free_block"] < failure.numbers["tried_to_allocate"]
    assert failure.numbers["step_peak"] <= failure.numbers["step_budget"]


def test_facts_without_proof_of_fit_are_capacity() -> None:
    """With the layout failing but no prediction and no same-shape step, the verdict is the stage's OOM."""
    report = _recorded("after-fix/cap-8GiB/attempt-002-error.json")
    failure = classify_exit(
        EXITED_OOM, dataclasses.replace(report, allocator=_facts_from_message(report)), ""
    )
    assert failure.kind is FailureKind.OOM_FORWARD and "nothing shows the step fits" in failure.evidence


def test_a_free_block_of_the_request_size_means_the_layout_did_not_fail() -> None:
    """A free block as big as the request existed: not fragmentation, whatever the fit."""
    facts = AllocatorFacts(300 * MIB, 6 * GIB, 7 * GIB, GIB, GIB, 400 * MIB, True, 10, CAP, 100 * GIB)
    verdict = judge(facts, {}, StepFit(6 * GIB, CAP, "memory model"))
    assert verdict is not None and not verdict.fragmentation and "existed" in verdict.why


def test_split_memory_that_does_not_cover_the_request_is_capacity() -> None:
    """Free split blocks plus headroom below the request: the memory was not there."""
    facts = AllocatorFacts(
        2 * GIB, 7 * GIB, 7_900 * MIB, 900 * MIB, 900 * MIB, 100 * MIB, False, 10, CAP, 100 * GIB
    )
    verdict = judge(facts, {}, StepFit(6 * GIB, CAP, "memory model"))
    assert verdict is not None and not verdict.fragmentation and "not there" in verdict.why


def test_facts_from_a_segment_list_count_only_the_pool_of_the_request() -> None:
    """Large-pool free blocks count for a 344 MiB request, small-pool ones do not; the largest is found."""
    segments = [
        {"segment_type": "large", "is_expandable": False, "blocks": [
            {"size": 200 * MIB, "state": "inactive"}, {"size": 1500 * MIB, "state": "active_allocated"},
            {"size": 150 * MIB, "state": "inactive"}]},
        {"segment_type": "small", "is_expandable": False, "blocks": [
            {"size": 1 * MIB, "state": "inactive"}, {"size": 1 * MIB, "state": "active_allocated"}]},
    ]  # fmt: skip
    stats = {"allocated_bytes.all.current": 1501 * MIB, "reserved_bytes.all.current": 1853 * MIB,
             "inactive_split_bytes.all.current": 351 * MIB}  # fmt: skip
    facts = facts_from_allocator(stats, segments, 344 * MIB, limit=2 * GIB, device_free=50 * GIB)
    assert facts.free_in_segments_bytes == 350 * MIB and facts.largest_free_block_bytes == 200 * MIB
    assert facts.block_for_request is False and facts.expandable_segments is False and facts.segments == 2
    assert facts.headroom_bytes == 2 * GIB - 1853 * MIB
    small = facts_from_allocator(stats, segments, 512 * 1024, limit=2 * GIB)
    assert small.free_in_segments_bytes == 351 * MIB and small.block_for_request is True


def test_allocator_facts_cross_the_report_file_typed() -> None:
    """An error report's allocator facts are read back as AllocatorFacts; junk makes the report unreadable."""
    facts = AllocatorFacts(1, 2, 3, 1, 1, 1, False, 1, 4, 5, None, (1, 512), 7, 9)
    report = ErrorReport(70, "OutOfMemoryError", "m", "", Stage.FORWARD, 3, True, allocator=facts,
                         memory_snapshot="/run/attempt-001/memory-snapshot.pickle")  # fmt: skip
    again = ErrorReport.from_json(report.to_json())
    assert again.allocator == facts and again.memory_snapshot == report.memory_snapshot
    raw = json.loads(report.to_json())
    raw["allocator"] = {"allocated_bytes": "lots"}
    with pytest.raises(ValueError):
        ErrorReport.from_json(json.dumps(raw))


def test_step_shapes_remember_the_last_completed_step_of_each_shape() -> None:
    """The child's record: a shape counts once its step completed; the one in flight does not yet."""
    from qlora_supervise.trainer_child.run.memory import StepShapes

    shapes = StepShapes()
    shapes.micro_batch((4, 2048))
    assert shapes.last_with(shapes.current) == (None, None)  # step 1 still running
    shapes.step_done(1, 7 * GIB)
    shapes.micro_batch((4, 1900))
    shapes.step_done(2, 7 * GIB + MIB)
    shapes.micro_batch((4, 2048))
    assert shapes.last_with(shapes.current) == (1, 7 * GIB)
    assert shapes.last_with((4, 1900)) == (2, 7 * GIB + MIB) and shapes.last_with(None) == (None, None)
