"""Typed journal records: one peak rule, JSON round trips, old journals, and the event vocabulary."""

from __future__ import annotations

import json
import re
from pathlib import Path

from qlora_supervise.policies.rungs import Survives
from qlora_supervise.supervisor.commands.status import describe
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.journal import (
    Action,
    AttemptPeakSource,
    AttemptRecord,
    DecisionRecord,
    Outcome,
    Peak,
    Phase,
    append_attempt,
    attempt_peak,
    read_attempts,
)
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage
from qlora_supervise.trainer_child.contract.spec import Knobs

GiB = 1024**3
RUN_DIRECTORY_DOC = Path(__file__).resolve().parent.parent / "docs" / "run-directory.md"


def _record(**changes: object) -> AttemptRecord:
    base = AttemptRecord(
        attempt=1,
        phase=Phase.TRAIN,
        knobs=Knobs("m"),
        outcome=Outcome.FAILED,
        started_at=1.0,
        ended_at=2.0,
        exit_code=70,
        signal=None,
        resumed_from=0,
        steps_completed=3,
        next_resume_from=3,
        lost_steps=0,
        peak=Peak(12 * GiB, AttemptPeakSource.ALLOCATOR_REPORT),
        failure=Failure(FailureKind.OOM_FORWARD, Stage.FORWARD, {"tried_to_allocate": GiB}, "report"),
        decision=DecisionRecord(
            Action.RESTART,
            "recompute",
            "gradient_checkpointing",
            {"gradient_checkpointing": (False, True)},
            Survives.ALL,
            Knobs("m", gradient_checkpointing=True),
        ),
    )
    return AttemptRecord(**{**base.__dict__, **changes})  # type: ignore[arg-type]


def test_the_allocator_peak_wins_over_a_sampled_nvml_peak() -> None:
    """Bug 5: an OOM whose allocator said 12.6 GiB is not reported at the 2.65 GiB NVML happened to see."""
    peak = attempt_peak(
        report_peak=int(12.6 * GiB),
        oom_need=None,
        heartbeat_peak=2 * GiB,
        nvml_peak=int(2.65 * GiB),
        rss_peak=None,
    )
    assert peak == Peak(int(12.6 * GiB), AttemptPeakSource.ALLOCATOR_REPORT)
    lines = describe(_record(peak=peak))
    assert any("12.6" in line and "allocator_report" in line for line in lines)


def test_the_peak_falls_back_in_one_order() -> None:
    """Without allocator numbers: heartbeat, then NVML, then RSS; nothing seen is no peak."""
    assert attempt_peak(None, None, 5, 7, 9) == Peak(5, AttemptPeakSource.HEARTBEAT)
    assert attempt_peak(None, None, None, 7, 9) == Peak(7, AttemptPeakSource.NVML)
    assert attempt_peak(None, None, None, None, 9) == Peak(9, AttemptPeakSource.RSS)
    assert attempt_peak(None, None, None, None, None) is None
    assert attempt_peak(None, 11, 5, None, None) == Peak(11, AttemptPeakSource.OOM_MESSAGE)


def test_a_record_round_trips_through_the_journal(tmp_path: Path) -> None:
    """What the journal writes is read back into the same typed record."""
    path = tmp_path / "attempts.jsonl"
    record = _record()
    append_attempt(path, record)
    records, bad = read_attempts(path)
    assert bad == 0 and records == [record]
    line = json.loads(path.read_text())
    assert (
        line["version"] == 2
        and line["failure"]["kind"] == "oom_forward"
        and line["peak"]["bytes"] == 12 * GiB
    )


def test_a_journal_line_from_a_newer_version_is_refused_not_misread(tmp_path: Path) -> None:
    """A line this version does not know is counted unreadable (and logged by the loop)."""
    path = tmp_path / "attempts.jsonl"
    path.write_text(json.dumps({"version": 99, "attempt": 1}) + "\n")
    assert read_attempts(path) == ([], 1)


def test_a_journal_line_nested_past_the_recursion_limit_is_counted_unreadable(tmp_path: Path) -> None:
    """A corrupt line is one unreadable line, whatever its shape: never an exception for status or run."""
    path = tmp_path / "attempts.jsonl"
    append_attempt(path, _record())
    with path.open("a") as out:
        out.write('{"version": 2, "attempt": ' + "[" * 100_000 + "\n")
    assert read_attempts(path) == ([_record()], 1)


def test_the_docs_list_every_event_name() -> None:
    """The event list of docs/run-directory.md and the Event vocabulary are the same set."""
    text = RUN_DIRECTORY_DOC.read_text(encoding="utf-8")
    section = text[text.index("Event names in `events.jsonl`") :]
    section = section[: section.index("\n\n")]
    listed = set(re.findall(r"`([a-z_]+)`", section)) - {"events"}
    assert listed == {event.value for event in Event}
