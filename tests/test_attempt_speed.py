"""Tokens/s per attempt: from its heartbeats into status, explain, the summary, the store and the settings."""

from __future__ import annotations

import io
import json
from pathlib import Path

from test_loop_fake_clock import LLAMA2_7B, FakeClock, _job, _run, _seams

from qlora_supervise.supervisor.commands.explain import explanation, print_table
from qlora_supervise.supervisor.commands.status import print_story, status_json
from qlora_supervise.supervisor.jobfile import load_job
from qlora_supervise.supervisor.loop.settings import model_shape, policy_settings, remember_attempt
from qlora_supervise.supervisor.record.history import measured_speed
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.supervisor.record.peak_store import default_path, read_speeds
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract.events import SpeedTrialEvent, TrialResult, event_line
from qlora_supervise.trainer_child.contract.spec import TrialCandidate


def _run_with_speeds(tmp_path: Path, rates: list[float]) -> RunDir:
    job = _job(tmp_path)
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA2_7B))
    assert _run(job, _seams(FakeClock(), {})) == 0
    events = tmp_path / "run" / "attempt-001" / "child-events.jsonl"
    with events.open("a", encoding="utf-8") as out:
        for step, rate in enumerate(rates, start=100):
            out.write(event_line("heartbeat", step=step, stage="forward", tokens_per_s=rate))
    return RunDir(tmp_path / "run")


def test_status_and_the_summary_show_each_attempts_tokens_per_s(tmp_path: Path) -> None:
    """The median of an attempt's heartbeats' tokens/s is in status (text and JSON)."""
    rd = _run_with_speeds(tmp_path, [900.0, 1000.0, 5000.0])
    assert status_json(rd)["attempts"][0]["tokens_per_s"] == 1000.0
    out = io.StringIO()
    print_story(rd, out)
    assert "speed: 1000 tokens/s (median of 3 heartbeat(s))" in out.getvalue()


def test_explain_json_has_predicted_against_measured_tokens_per_s(tmp_path: Path) -> None:
    """explain --json: the measured tokens/s beside the throughput model's for the same knobs."""
    rd = _run_with_speeds(tmp_path, [1200.0])
    row = explanation(rd)["attempts"][0]
    assert row["tokens_per_s"] == 1200.0 and row["predicted_tokens_per_s"] > 0
    out = io.StringIO()
    print_table(explanation(rd), out)
    assert "tok/s (pred)" in out.getvalue() and "1200 (" in out.getvalue()


def test_a_measured_attempt_goes_to_the_store_and_the_runs_settings(tmp_path: Path) -> None:
    """After a journalled attempt, its tokens/s is stored per host and corrects this run's ranking."""
    rd = _run_with_speeds(tmp_path, [1500.0])
    job = load_job(str(tmp_path / "job.yaml"))
    shape = model_shape(tmp_path / "model")
    assert shape is not None
    settings = policy_settings(job)
    record = read_attempts(rd.attempts)[0][0]
    updated = remember_attempt(settings, job, record, measured_speed(rd, record))
    assert updated.speeds[-1].tokens_per_s == 1500.0 and updated.speeds[-1].knobs == record.knobs
    assert read_speeds(default_path(), shape)[-1].tokens_per_s == 1500.0
    assert any(s.tokens_per_s == 1500.0 for s in policy_settings(job).speeds)  # the next run reads it


def test_the_speed_trials_candidates_are_stored_and_a_switch_names_the_trained_knobs(tmp_path: Path) -> None:
    """A trial that switched: the attempt's speed belongs to the chosen candidate, and the other
    candidate's measured rate is stored too, for the next plan on this host."""
    rd = _run_with_speeds(tmp_path, [2000.0])
    job = load_job(str(tmp_path / "job.yaml"))
    record = read_attempts(rd.attempts)[0][0]
    k = record.knobs
    planned = TrialCandidate(k.micro_batch_size, k.grad_accum, k.gradient_checkpointing)
    faster = TrialCandidate(k.micro_batch_size // 2, k.grad_accum * 2, not k.gradient_checkpointing)
    event = SpeedTrialEvent(
        (TrialResult(planned, 1500.0, None, 1.0), TrialResult(faster, 1900.0, None, 1.0)), 2.0
    )
    with (rd.attempt_dir(1) / "child-events.jsonl").open("a", encoding="utf-8") as out:
        out.write(event.to_line())
    updated = remember_attempt(policy_settings(job), job, record, measured_speed(rd, record))
    trained = updated.speeds[-1].knobs
    assert (trained.micro_batch_size, trained.gradient_checkpointing) == (
        faster.micro_batch_size,
        faster.gradient_checkpointing,
    )
    shape = model_shape(tmp_path / "model")
    assert shape is not None
    stored = {(s.knobs.micro_batch_size, s.tokens_per_s) for s in read_speeds(default_path(), shape)}
    assert {(planned.micro_batch_size, 1500.0), (faster.micro_batch_size, 2000.0)} <= stored
