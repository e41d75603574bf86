"""A spurious OOM (issue 33): the allocator's numbers say the request fit, so the config is retried once.

Pure rules on the message's numbers and the child's allocator facts, the decision, and whole runs of
the loop on the fake clock (tests/test_loop_fake_clock.py's seams, with a child that fails spuriously).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import test_loop_fake_clock as fake

from qlora_supervise.policies.decide import RETRY_RUNG, SPURIOUS_KEY, PastAttempt, Restart, Settings, decide
from qlora_supervise.supervisor.diagnosis import fragmentation
from qlora_supervise.supervisor.diagnosis.classify import classify_exit, classify_text
from qlora_supervise.supervisor.facts.failure import ChildExit, Failure
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.trainer_child.contract.allocator import AllocatorFacts
from qlora_supervise.trainer_child.contract.codes import ExitCode, FailureKind, Stage
from qlora_supervise.trainer_child.contract.events import event_line
from qlora_supervise.trainer_child.contract.oom_message import parse_numbers
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import Knobs

MIB, GIB = 1024**2, 1024**3
#: The driver had 9.8 GiB free for a 1.5 GiB request (the symptom of pytorch/pytorch#189504).
SPURIOUS = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB. GPU 0 has a total capacity "
    "of 23.55 GiB of which 9.80 GiB is free. Including non-PyTorch memory, this process has 13.65 GiB "
    "memory in use. Of the allocated memory 12.90 GiB is allocated by PyTorch, and 200.00 MiB is reserved "
    "by PyTorch but unallocated."
)
#: A recorded H200 report's numbers (bench/results/recovery-h200-2026-12-01, 8 GiB cap): a capacity OOM.
H200_CAPPED = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 172.00 MiB. GPU 0 has a total capacity "
    "of 139.80 GiB of which 131.17 GiB is free. Including non-PyTorch memory, this process has 8.62 GiB "
    "memory in use. 8.00 GiB allowed; Of the allocated memory 7.77 GiB is allocated by PyTorch, and "
    "182.28 MiB is reserved by PyTorch but unallocated."
)


def _facts(allocated: int, block: bool, largest: int = 700 * MIB) -> AllocatorFacts:
    return AllocatorFacts(
        requested_bytes=172 * MIB, allocated_bytes=allocated, reserved_bytes=8140 * MIB,
        free_in_segments_bytes=869 * MIB, inactive_split_bytes=0, largest_free_block_bytes=largest,
        block_for_request=block, segments=12, limit_bytes=8 * GIB, device_free_bytes=120 * GIB,
    )  # fmt: skip


def test_free_memory_well_above_the_request_marks_the_oom_spurious() -> None:
    """The driver's free memory at least the request plus the margin above it: spurious, kind kept."""
    found = classify_text(SPURIOUS)
    assert found.kind is FailureKind.OOM_FORWARD
    assert found.numbers[SPURIOUS_KEY] == parse_numbers(SPURIOUS)["free"]
    assert "spurious" in found.evidence and "retried once" in found.evidence


def test_a_capped_process_counts_the_room_under_its_cap_not_the_device() -> None:
    """Under a cap the device's 131 GiB free says nothing: what is left under the cap is 50 MiB."""
    assert (
        fragmentation.judge_spurious(parse_numbers(H200_CAPPED) | {"reserved_total": int(7.95 * GIB)}) is None
    )
    assert SPURIOUS_KEY not in classify_text(H200_CAPPED).numbers


def test_free_memory_just_above_the_request_is_not_enough() -> None:
    """Free memory above the request by less than the margin (rounding, a workspace) is no evidence."""
    numbers = {"tried_to_allocate": 1 * GIB, "free": 1 * GIB + 400 * MIB}
    assert fragmentation.judge_spurious(numbers) is None
    assert fragmentation.judge_spurious({**numbers, "free": 2 * GIB}) is not None


def test_a_free_block_with_the_steps_memory_still_held_is_spurious() -> None:
    """The child's facts: a fitting free block while nothing the step held was released yet."""
    numbers = parse_numbers(H200_CAPPED)
    found = fragmentation.judge_spurious(numbers, _facts(allocated=numbers["already_allocated"], block=True))
    assert found is not None and found[1] == 700 * MIB


def test_a_free_block_after_the_step_released_its_memory_is_not() -> None:
    """The recorded H200 capacity OOM: 0.7 GiB freed between the raise and the facts: no evidence."""
    assert (
        fragmentation.judge_spurious(parse_numbers(H200_CAPPED), _facts(allocated=7270 * MIB, block=True))
        is None
    )
    assert (
        fragmentation.judge_spurious(parse_numbers(H200_CAPPED), _facts(allocated=7956 * MIB, block=False))
        is None
    )


def test_contention_is_not_marked_spurious() -> None:
    """Another process holding most of the card is a reason, not an accident: no spurious mark."""
    found = classify_text(fake.CONTENTION.replace("200.00 MiB is free", "3.00 GiB is free"))
    assert found.kind is FailureKind.OOM_CONTENTION and SPURIOUS_KEY not in found.numbers


def test_the_childs_report_is_marked_from_its_facts() -> None:
    """A report whose allocator facts show the fitting block is marked, whatever the message's free says."""
    numbers = parse_numbers(H200_CAPPED)
    report = ErrorReport(
        exit_code=int(ExitCode.OOM), exception_type="torch.OutOfMemoryError", message=H200_CAPPED,
        traceback="", stage="forward", step=7, is_oom=True, device="cuda:0",
        allocator=_facts(allocated=numbers["already_allocated"], block=True),
    )  # fmt: skip
    found = classify_exit(ChildExit(returncode=int(ExitCode.OOM)), report, "")
    assert found.kind is FailureKind.OOM_FORWARD and found.numbers[SPURIOUS_KEY] == 700 * MIB
    assert Failure.from_json(found.to_json()).numbers[SPURIOUS_KEY] == 700 * MIB  # survives the journal


BASE = Knobs(model="/m/7b", micro_batch_size=8, grad_accum=2, gradient_checkpointing=False)


@dataclasses.dataclass(frozen=True)
class _Failure:
    kind: FailureKind
    stage: Stage = Stage.FORWARD
    numbers: dict[str, int] = dataclasses.field(default_factory=lambda: {SPURIOUS_KEY: 9 * GIB})
    fatal_xid: int | None = None


def _past(steps: int = 0, knobs: Knobs = BASE, rung: str | None = None) -> PastAttempt:
    return PastAttempt(knobs, FailureKind.OOM_FORWARD, steps, stage=Stage.FORWARD, rung=rung)


def test_a_spurious_oom_is_retried_once_unchanged() -> None:
    """The first spurious OOM restarts with the same knobs, the rung named and the reason said."""
    decision = decide(_Failure(FailureKind.OOM_FORWARD), BASE, [_past()], Settings())
    assert isinstance(decision, Restart)
    assert (decision.rung, decision.knobs, dict(decision.changes)) == (RETRY_RUNG, BASE, {})
    assert "retry the same config once" in decision.why


def test_the_same_failure_right_after_the_retry_walks_the_ladder() -> None:
    """A second identical failure with no step trained in between takes the stage's first rung."""
    decision = decide(_Failure(FailureKind.OOM_FORWARD), BASE, [_past(), _past()], Settings())
    assert isinstance(decision, Restart) and decision.rung == "gradient_checkpointing"


def test_a_retry_that_trained_steps_before_failing_again_walks_the_ladder() -> None:
    """Once per config: a config already retried as spurious climbs, even after progress in between."""
    history = [_past(rung=RETRY_RUNG), _past(steps=5)]
    decision = decide(_Failure(FailureKind.OOM_FORWARD), BASE, history, Settings())
    assert isinstance(decision, Restart) and decision.rung == "gradient_checkpointing"


def test_another_config_gets_its_own_spurious_retry() -> None:
    """The count is per config: a retry had with other knobs does not use up this config's."""
    other = dataclasses.replace(BASE, micro_batch_size=BASE.micro_batch_size * 2)
    history = [_past(knobs=other, rung=RETRY_RUNG), _past(steps=5)]
    decision = decide(_Failure(FailureKind.OOM_FORWARD), BASE, history, Settings())
    assert isinstance(decision, Restart) and decision.rung == RETRY_RUNG


def test_an_unmarked_oom_walks_the_ladder_at_once() -> None:
    """Without the mark nothing changes: the first OOM climbs."""
    decision = decide(_Failure(FailureKind.OOM_FORWARD, numbers={}), BASE, [_past()], Settings())
    assert isinstance(decision, Restart) and decision.rung == "gradient_checkpointing"


class SpuriousChild(fake.FakeChild):
    """The fake clock's child, plus ``spurious@N``: trains to step N-1, then a spurious forward OOM."""

    def _finish(self) -> int | None:
        name, _, at = self.behaviour.partition("@")
        if name != "spurious":
            return super()._finish()
        spec, start, last = self.spec, fake._resume_step(self.spec), int(at) - 1
        with Path(spec.events_file).open("a", encoding="utf-8") as out:
            for step in range(start + 1, last + 1):
                out.write(event_line("heartbeat", step=step, stage="forward", peak=GIB))
        checkpoint = fake._checkpoint(spec, last) if last > start else None
        return self._report("forward", ExitCode.OOM, "torch.OutOfMemoryError", SPURIOUS, checkpoint)


@pytest.fixture
def spurious_children(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake, "FakeChild", SpuriousChild)


@pytest.mark.usefixtures("spurious_children")
def test_a_run_retries_a_spurious_oom_unchanged_and_finishes(tmp_path: Path) -> None:
    """A whole run: the spurious OOM at step 3 is retried with the same knobs, journaled, and the run ends."""
    code = fake._run(fake._job(tmp_path), fake._seams(fake.FakeClock(), {1: "spurious@3"}))
    assert code == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert [r.outcome.value for r in records] == ["failed", "succeeded"]
    first = records[0]
    assert first.decision is not None and first.decision.rung == RETRY_RUNG
    assert records[1].knobs == first.knobs and records[1].resumed_from == 2
    assert first.failure is not None and SPURIOUS_KEY in first.failure.numbers
    retries = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e.get("event") == "retry"]
    assert retries and retries[0]["rung"] == RETRY_RUNG


@pytest.mark.usefixtures("spurious_children")
def test_a_run_whose_retry_fails_the_same_way_goes_down_the_ladder(tmp_path: Path) -> None:
    """The retry fails the same way before any step: the next attempt takes the forward ladder's rung."""
    plan = {1: "spurious@1", 2: "spurious@1"}
    code = fake._run(fake._job(tmp_path), fake._seams(fake.FakeClock(), plan))
    assert code == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    rungs = [r.decision.rung for r in records if r.decision is not None]
    assert rungs[:2] == [RETRY_RUNG, "gradient_checkpointing"]
    assert records[2].knobs.gradient_checkpointing and not records[0].knobs.gradient_checkpointing


@pytest.mark.usefixtures("spurious_children")
def test_a_run_whose_retry_fails_again_after_progress_goes_down_the_ladder(tmp_path: Path) -> None:
    """The retry trains steps and then fails spuriously again: retried once only, the ladder takes it."""
    plan = {1: "spurious@3", 2: "spurious@6"}
    code = fake._run(fake._job(tmp_path), fake._seams(fake.FakeClock(), plan))
    assert code == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[1].steps_progressed > 0
    rungs = [r.decision.rung for r in records if r.decision is not None]
    assert rungs[:2] == [RETRY_RUNG, "gradient_checkpointing"]
