"""Changed jobs between runs: every version kept, safe fields applied, training changes need --restart.

Issue 11 item 6, with the real supervisor: the bookkeeping of versions and lifted verdicts on the
fake clock (a hang costs no wall time there), the rest with the scripted child (real processes).
"""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from qlora_supervise.supervisor.commands.cli import _build_parser
from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.exit_codes import SupervisorExit
from qlora_supervise.supervisor.record.journal import read_attempts, read_lifts, read_state

sys.path.insert(0, str(Path(__file__).parent))
from run_scripted import scripted_seams
from test_loop import _events, _job
from test_loop_fake_clock import FakeClock, _seams
from test_loop_fake_clock import _job as _fake_job


def _run(job: Path, **flags: bool) -> int:
    seams = scripted_seams()
    return run_job(str(job), plain=True, seams=seams, console=io.StringIO(), install_signals=False, **flags)


def _edit(job: Path, section: str, **fields: Any) -> None:
    raw = yaml.safe_load(job.read_text())
    raw.setdefault(section, {}).update(fields)
    job.write_text(yaml.safe_dump(raw))


def _run_fake(job: Path, plan: dict[int, str], default: str = "ok") -> int:
    seams = _seams(FakeClock(), plan, default=default)
    return run_job(str(job), plain=True, seams=seams, console=io.StringIO(), install_signals=False)


def test_every_submitted_version_is_kept_and_the_first_survives_two_changes(tmp_path: Path) -> None:
    """Issue 11 item 6: job.v1.yaml, job.v2.yaml, job.v3.yaml hold each submission as written."""
    job = _fake_job(tmp_path, hang_timeout="1s")
    texts = [job.read_text()]
    assert _run_fake(job, {}, default="hang@2") == 3
    for timeout in ("2s", "3s"):
        _edit(job, "supervise", hang_timeout=timeout)
        texts.append(job.read_text())
        _run_fake(job, {}, default="hang@2")
    run = tmp_path / "run"
    assert [(run / f"job.v{n}.yaml").read_text() for n in (1, 2, 3)] == texts
    assert (run / "job.yaml").read_text() == texts[-1]
    assert not (run / "job.previous.yaml").exists()


def test_a_safe_change_lifts_the_verdict_and_is_journaled(tmp_path: Path) -> None:
    """Issue 11 item 6: a run that gave up goes on after a supervise.* change, logged and journaled."""
    # Three hangs with no step trained in between: the crash-loop limit gives up (exit 3).
    job, hangs = _fake_job(tmp_path, hang_timeout="1s"), {1: "hang@2", 2: "hang@2", 3: "hang@2"}
    assert _run_fake(job, hangs) == 3
    _edit(job, "supervise", hang_timeout="5s")
    assert _run_fake(job, hangs) == 0
    changed = _events(tmp_path, "job_changed")[0]
    assert changed["changes"] == {"supervise.hang_timeout": {"old": 1.0, "new": 5.0, "safe": True}}
    lifts = read_lifts(tmp_path / "run" / "attempts.jsonl")
    assert [(lift.after_attempt, lift.verdict) for lift in lifts] == [(3, "gave_up")]
    assert _events(tmp_path, "verdict_lifted")
    records, bad = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert bad == 0 and records[-1].outcome == "succeeded" and records[-1].attempt == 4


def test_retry_lifts_a_config_error_verdict_that_otherwise_stands(tmp_path: Path) -> None:
    """Issue 11 item 6: run_already_ended names the way out, and `run --retry` takes it."""
    job = _job(tmp_path, {"1": "config_error"})
    assert _run(job) == 4
    assert _run(job) == 4
    ended = _events(tmp_path, "run_already_ended")[0]
    assert "--retry" in ended["fix"] and "--restart" in ended["fix"]
    assert _run(job, retry=True) == 0
    assert [lift.why for lift in read_lifts(tmp_path / "run" / "attempts.jsonl")] == ["run --retry"]


def test_a_change_of_what_is_trained_is_refused_without_restart(tmp_path: Path) -> None:
    """Issue 11 item 6: a new lora.r or learning_rate is refused (exit 2) with the diff and the flag."""
    job = _job(tmp_path, {"default": "ok"})
    assert _run(job) == 0
    _edit(job, "lora", r=16)
    _edit(job, "train", learning_rate=1.0e-4)
    with pytest.raises(SupervisorExit) as refused:
        _run(job)
    assert int(refused.value.code) == 2
    message = refused.value.message
    assert "lora.r: 8 -> 16" in message and "train.learning_rate: 0.0002 -> 0.0001" in message
    assert "run --restart" in message
    assert not (tmp_path / "run" / "job.v2.yaml").exists()


def test_restart_starts_a_new_generation_and_keeps_the_old_one_aside(tmp_path: Path) -> None:
    """Issue 11 item 6: `run --restart` moves the old generation to generations/1/ and trains anew."""
    job = _job(tmp_path, {"default": "ok"})
    assert _run(job) == 0
    run = tmp_path / "run"
    old_journal = (run / "attempts.jsonl").read_text()
    _edit(job, "lora", r=16)
    assert _run(job, restart=True) == 0
    old = run / "generations" / "1"
    assert (old / "attempts.jsonl").read_text() == old_journal
    assert (old / "adapter").is_dir() and (old / "checkpoints").is_dir() and (old / "job.yaml").is_file()
    records, _ = read_attempts(run / "attempts.jsonl")
    assert [r.attempt for r in records] == [1] and records[0].knobs.lora_r == 16
    assert records[0].resumed_from == 0
    adapters = [json.loads((p / "adapter.bin").read_text()) for p in (run / "checkpoints").iterdir()]
    assert adapters and all(a["r"] == 16 for a in adapters)
    assert read_state(run / "state.json").run_state.value == "succeeded"  # type: ignore[union-attr]
    assert _events(tmp_path, "generation_started")


def test_restart_says_the_changes_start_a_new_generation_not_that_they_need_it(tmp_path: Path) -> None:
    """Issue 21 item 18: `run --restart` says the diff goes into the new generation, not "needs --restart"."""
    job = _job(tmp_path, {"default": "ok"})
    assert _run(job) == 0
    _edit(job, "lora", r=16)
    _edit(job, "supervise", hang_timeout="3s")
    console = io.StringIO()
    code = run_job(
        str(job), plain=True, seams=scripted_seams(), console=console, install_signals=False, restart=True
    )
    assert code == 0
    said = console.getvalue()
    assert "needs --restart" not in said and "applies on resume" not in said
    assert "new generation (--restart)" in said
    assert "lora.r: 8 -> 16  (the new generation trains with it from step 0)" in said


def test_run_accepts_restart_and_retry_flags() -> None:
    """Issue 11 item 6: the CLI has `run --restart` and `run --retry`."""
    args = _build_parser().parse_args(["run", "--restart", "--retry", "job.yaml"])
    assert args.restart and args.retry
