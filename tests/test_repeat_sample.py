"""The sample behind a repeating OOM (issue 33): the rows in flight named, a repeat told and costed.

The child names the micro-batch a training step's OOM happened on; the failure keeps it, ``status``
prints it, and when the attempt before failed at the same data position the decision says so and
whether a shorter max_seq_len would cut only those rows or many. Whole runs on the fake clock
(tests/test_loop_fake_clock.py's seams) with a child that fails at the same position each time.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import test_loop_fake_clock as fake
from _child import events, log_tail, make_spec, report, run_child

from qlora_supervise.supervisor.commands.status import describe
from qlora_supervise.supervisor.diagnosis.advice import batch_numbers, batch_of, repeat_note
from qlora_supervise.supervisor.diagnosis.classify import classify_exit
from qlora_supervise.supervisor.facts.failure import ChildExit, Failure
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract.attempt_facts import BatchInFlight, SampleLengths
from qlora_supervise.trainer_child.contract.codes import ExitCode, FailureKind, Stage
from qlora_supervise.trainer_child.contract.events import event_line
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import AttemptSpec

LONG = BatchInFlight(step=7, micro=2, lengths=(512, 96, 80, 64), rows=(4812, 77, 12, 301))


def _report(batch: BatchInFlight | None) -> ErrorReport:
    return ErrorReport(
        exit_code=int(ExitCode.OOM), exception_type="torch.OutOfMemoryError",
        message=fake.OOM.removeprefix("torch.OutOfMemoryError: "), traceback="", stage="forward",
        step=6, is_oom=True, device="cuda:0", batch=batch,
    )  # fmt: skip


def _failure(batch: BatchInFlight) -> Failure:
    return Failure(FailureKind.OOM_FORWARD, Stage.FORWARD, batch_numbers(batch), "test")


def test_the_batch_in_flight_survives_the_report_file() -> None:
    """The report's micro-batch (step, index, lengths, rows) reads back as written."""
    assert ErrorReport.from_json(_report(LONG).to_json()).batch == LONG
    assert ErrorReport.from_json(_report(None).to_json()).batch is None


def test_the_failure_keeps_the_rows_and_status_prints_them() -> None:
    """The classified failure keeps the rows in its numbers, and the journal's record keeps them."""
    found = classify_exit(ChildExit(returncode=int(ExitCode.OOM)), _report(LONG), "")
    again = Failure.from_json(found.to_json())
    assert again.numbers["batch_rows"] == [4812, 77, 12, 301] and again.numbers["batch_step"] == 7


def test_a_repeat_whose_rows_alone_are_long_says_only_they_are_cut() -> None:
    """Only the failing row is longer than half of max_seq_len: a shorter one cuts only it (its tokens)."""
    lengths = SampleLengths(rows=6, lengths=(64, 80, 96, 120, 200, 3904))
    note = repeat_note(_failure(LONG), _failure(LONG), 512, lengths)
    assert note is not None and "repeats at the same data position" in note
    assert "row 4812 (512 tokens)" in note
    # The row's 3904 tokens were already cut to 512 by max_seq_len: 256 more go, not 3648.
    assert "would cut only these 1 row(s) (256 tokens)" in note


def test_a_repeat_among_many_long_rows_says_many_would_be_cut() -> None:
    """Many rows longer than the shorter max_seq_len: the note says how many, not only these."""
    lengths = SampleLengths(rows=6, lengths=(64, 300, 400, 450, 500, 3904))
    note = repeat_note(_failure(LONG), _failure(LONG), 512, lengths)
    assert note is not None and "would cut 5 of 6 rows" in note and "not only these 1" in note


def test_another_data_position_is_no_repeat() -> None:
    """A failure at another step (or none recorded) before it: no note."""
    other = BatchInFlight(step=8, micro=0, lengths=(512, 96, 80, 64), rows=(5, 6, 7, 8))
    assert repeat_note(_failure(LONG), _failure(other), 512, None) is None
    assert repeat_note(_failure(LONG), None, 512, None) is None


def test_the_cut_cost_counts_only_tokens_max_seq_len_kept() -> None:
    """Rows already longer than max_seq_len lose only what it kept above the shorter length."""
    lengths = SampleLengths(rows=4, lengths=(64, 300, 600, 5000))
    note = repeat_note(_failure(LONG), _failure(LONG), 512, lengths)
    # 300 -> 256 (44), 600 -> 512 -> 256 (256), 5000 -> 512 -> 256 (256): 556 tokens.
    assert note is not None and "would cut 3 of 4 rows (556 tokens)" in note


def test_the_same_row_at_the_same_step_after_the_usual_rungs_is_a_repeat() -> None:
    """A halved micro-batch (another index, fewer rows) or a shorter max_seq_len (shorter lengths):
    the same row failing at the same optimizer step is still the same data position."""
    halved = BatchInFlight(step=7, micro=5, lengths=(512, 96), rows=(4812, 77))
    shortened = BatchInFlight(step=7, micro=2, lengths=(256, 96, 80, 64), rows=(4812, 77, 12, 301))
    for after in (halved, shortened):
        note = repeat_note(_failure(after), _failure(LONG), 512, None)
        assert note is not None and "repeats at the same data position" in note
    other_rows = BatchInFlight(step=7, micro=5, lengths=(512, 96), rows=(5, 6))
    assert repeat_note(_failure(other_rows), _failure(LONG), 512, None) is None


def test_without_rows_the_same_longest_row_at_the_same_step_is_a_repeat() -> None:
    """Rows not looked up (packed sequences): the same step and a longest row of the same length."""
    packed = BatchInFlight(step=7, micro=0, lengths=(512, 30))
    assert repeat_note(_failure(packed), _failure(LONG), 512, None) is not None
    shorter = BatchInFlight(step=7, micro=0, lengths=(300, 30))
    assert repeat_note(_failure(shorter), _failure(LONG), 512, None) is None


def test_a_batch_record_whose_rows_and_lengths_differ_reads_as_none() -> None:
    """A corrupt record (a row index per length missing) is no batch: nothing raises, no note."""
    raw = {"step": 7, "micro": 0, "lengths": [512, 96], "rows": [4812]}
    assert BatchInFlight.from_json_dict(raw) is None
    numbers = {"batch_step": 7, "batch_micro": 0, "batch_lengths": [512, 96], "batch_rows": [4812]}
    corrupt = Failure(FailureKind.OOM_FORWARD, Stage.FORWARD, numbers, "test")
    assert batch_of(numbers) is None
    assert repeat_note(corrupt, corrupt, 512, None) is None


class RepeatingChild(fake.FakeChild):
    """The fake clock's child, plus ``longrow@N``: the OOM at step N on the same micro-batch each time."""

    def _finish(self) -> int | None:
        name, _, at = self.behaviour.partition("@")
        if name != "longrow":
            return super()._finish()
        spec, start, last = self.spec, fake._resume_step(self.spec), int(at) - 1
        with Path(spec.events_file).open("a", encoding="utf-8") as out:
            lengths = SampleLengths(rows=20, lengths=(30,) * 19 + (1900,))
            out.write(event_line("loaded", train_rows=20, **lengths.fields()))
            for step in range(start + 1, last + 1):
                out.write(event_line("heartbeat", step=step, stage="forward", peak_bytes=fake.GiB))
        checkpoint = fake._checkpoint(spec, last) if last > start else None
        batch = BatchInFlight(step=int(at), micro=0, lengths=(256, 30, 30, 30), rows=(13, 2, 5, 9))
        report = _report(batch)
        Path(spec.error_file).write_text(report.to_json(), encoding="utf-8")
        assert checkpoint is None or Path(checkpoint).is_dir()
        return int(ExitCode.OOM)


@pytest.fixture
def repeating_children(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fake, "FakeChild", RepeatingChild)


@pytest.mark.usefixtures("repeating_children")
def test_a_run_that_fails_at_the_same_row_twice_says_so_in_its_decision(tmp_path: Path) -> None:
    """Two attempts fail on the same micro-batch: the second decision names the row and costs max_seq_len."""
    plan = {1: "longrow@3", 2: "longrow@3"}
    assert fake._run(fake._job(tmp_path), fake._seams(fake.FakeClock(), plan)) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    first, second = records[0], records[1]
    assert first.decision is not None and "repeats" not in first.decision.why
    assert second.decision is not None and "repeats at the same data position" in second.decision.why
    assert "row 13 (256 tokens)" in second.decision.why
    assert "max_seq_len 128 would cut only these 1 row(s) (128 tokens)" in second.decision.why
    text = "\n".join(describe(second, RunDir(tmp_path / "run")))
    assert "in flight: step 3, micro-batch 0: row 13 (256 tokens), row 2 (30 tokens)" in text
    assert "batch_rows" not in text  # the rows have their own line, not the bytes line


def _long_row_data(tiny: Path, out: Path, long_at: int) -> Path:
    """Short rows of the tiny set, and one row (at ``long_at``) ten times as long."""
    rows = [json.loads(line)["text"] for line in (tiny / "data.jsonl").read_text().splitlines()[:40]]
    texts = [text[:160] for text in rows]
    texts[long_at] = " ".join(rows[:3])[:1900]
    out.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    return out


def _peak_jump(spec: AttemptSpec) -> tuple[int, int]:
    """The attempt's peak (its high-water mark) before and after its largest rise between beats."""
    peaks = [e["peak_bytes"] for e in events(spec) if e["event"] == "heartbeat" and e.get("peak_bytes")]
    rise = max(range(1, len(peaks)), key=lambda i: peaks[i] - peaks[i - 1])
    return peaks[rise - 1], peaks[rise]


@pytest.mark.slow
def test_a_real_child_names_the_long_row_its_oom_repeats_on(tiny_dir: Path, tmp_path: Path) -> None:
    """One row ten times as long: under a cap between its step's peak and the others', two attempts
    fail on it, each report names that row and its length, and the failures are one data position."""
    data = _long_row_data(tiny_dir, tmp_path / "data.jsonl", long_at=13)
    knobs = {"micro_batch_size": 4, "grad_accum": 1, "max_seq_len": 1024}
    train = {"max_steps": 10, "save_steps": 100}
    free = make_spec(tiny_dir, tmp_path / "free", knobs=knobs, train=train, data={"path": str(data)})
    assert run_child(free) == ExitCode.OK, log_tail(free)
    below, above = _peak_jump(free)
    assert above - below > 64 * 1024**2, (below, above)  # the long row's step needs visibly more
    cap = (below + above) // 2

    reports = []
    for attempt in (1, 2):
        spec = make_spec(tiny_dir, tmp_path / "capped", attempt, knobs=knobs, train=train,
                         data={"path": str(data)}, cpu_memory_limit=cap)  # fmt: skip
        assert run_child(spec) == ExitCode.OOM, log_tail(spec)
        reports.append(report(spec))
    first, second = (r.batch for r in reports)
    assert first is not None and second is not None and first.same_position(second)
    assert first.rows is not None and 13 in first.rows
    assert max(first.lengths) == first.lengths[first.rows.index(13)] > 5 * min(first.lengths)
    failures = [classify_exit(ChildExit(returncode=int(ExitCode.OOM)), r, "") for r in reports]
    note = repeat_note(failures[1], failures[0], 1024, None)
    assert note is not None and f"row 13 ({max(first.lengths)} tokens)" in note
