"""Issue 21's loop items with the scripted child: host OOM kills, the journal's steps, give-ups, extending.

Real supervisor, scripted child (``tests/scripted_child.py``), seconds per test.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.commands.status import status_command
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts

sys.path.insert(0, str(Path(__file__).parent))
from run_scripted import scripted_seams
from test_loop import MAX_STEPS
from test_loop import _job as loop_job


def _job(tmp_path: Path, plan: dict[str, str], train: dict[str, Any] | None = None, **supervise: Any) -> Path:
    """test_loop's job for a fake model dir and the scripted child's plan, with train overrides."""
    return loop_job(tmp_path, plan, train=train, **supervise)


def _run(job: Path, **flags: Any) -> int:
    return run_job(
        str(job), plain=True, seams=scripted_seams(), console=io.StringIO(), install_signals=False, **flags
    )


def _events(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == name]


def test_host_oom_kill_after_progress_keeps_the_heartbeats_stage_and_retries_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel OOM kill at step 3 is recorded at the heartbeat's stage and retried with the same knobs."""
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    monkeypatch.setenv("QLORA_SUPERVISE_CGROUP_MEMORY_EVENTS", str(events))
    monkeypatch.setenv("SCRIPTED_CHILD_OOM_EVENTS", str(events))
    assert _run(_job(tmp_path, {"1": "sigkill@3"})) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    first = records[0]
    assert first.failure is not None and first.failure.kind == "host_oom"
    assert first.failure.stage.value == "forward"
    assert first.decision is not None and first.decision.rung == "retry_unchanged"
    assert records[1].knobs == first.knobs and records[1].outcome == "succeeded"


def test_an_attempt_that_trained_nothing_records_zero_steps_completed(tmp_path: Path) -> None:
    """A resumed attempt that hangs before its first step records 0 steps completed, not the resumed step."""
    assert _run(_job(tmp_path, {"1": "killed@7", "2": "hang@5"})) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    hung = records[1]
    assert hung.failure is not None and hung.failure.kind == "hang"
    assert (hung.resumed_from, hung.steps_completed, hung.lost_steps) == (4, 0, 0)
    assert hung.next_resume_from == 4 and hung.steps_progressed == 0
    assert records[0].steps_completed == 6 and records[-1].steps_completed == MAX_STEPS


def _raise_max_steps(job: Path, steps: int) -> None:
    raw = yaml.safe_load(job.read_text())
    raw["train"]["max_steps"] = steps
    job.write_text(yaml.safe_dump(raw))


def test_a_finished_run_with_more_max_steps_trains_on_from_its_last_checkpoint(tmp_path: Path) -> None:
    """Raising max_steps on a finished run resumes from its newest checkpoint and trains to the new end."""
    job = _job(tmp_path, {"default": "ok"})
    assert _run(job) == 0
    _raise_max_steps(job, 14)
    assert _run(job) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert [r.outcome for r in records] == ["succeeded", "succeeded"]
    assert records[1].resumed_from >= 8 and records[1].steps_completed == 14
    assert records[1].knobs == records[0].knobs
    assert not _events(tmp_path, "run_already_ended")
    assert _run(job) == 0  # and the longer run is finished in turn
    assert len(read_attempts(tmp_path / "run" / "attempts.jsonl")[0]) == 2


def test_retry_on_a_finished_run_says_how_to_train_further_not_to_retry(tmp_path: Path) -> None:
    """A finished run's run_already_ended names max_steps and --restart, not --retry."""
    job = _job(tmp_path, {"default": "ok"})
    assert _run(job) == 0
    assert _run(job, retry=True) == 0
    fix = _events(tmp_path, "run_already_ended")[0]["fix"]
    assert "max_steps" in fix and "--restart" in fix and "--retry" not in fix


def test_retry_after_an_oom_give_up_takes_the_ladders_next_rung(tmp_path: Path) -> None:
    """`run --retry` after the OOM attempt budget ran out runs the next rung, not the config that failed."""
    job = _job(tmp_path, {"1": "oom_forward@3", "2": "oom_forward@3", "default": "ok"}, max_attempts=2)
    assert _run(job) == 3
    assert _run(job, retry=True) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[1].knobs.gradient_checkpointing and records[1].decision is not None
    assert records[1].decision.action.value == "give_up"
    assert records[2].knobs != records[1].knobs
    assert records[2].knobs.micro_batch_size == records[1].knobs.micro_batch_size // 2
    assert records[2].outcome == "succeeded"


def test_a_memory_give_up_names_the_cap_the_smallest_peak_and_what_would_help(tmp_path: Path) -> None:
    """An OOM give-up under a GPU cap says which cap, the smallest peak seen and the ways out."""
    plan = {str(n): "oom_forward@3" for n in range(1, 4)}
    job = _job(tmp_path, plan, max_attempts=3)
    raw = yaml.safe_load(job.read_text())
    raw["resources"]["gpu_memory_limit"] = "6GiB"
    job.write_text(yaml.safe_dump(raw))
    assert _run(job) == 3
    why = _events(tmp_path, "gave_up")[0]["why"]
    assert "the cap is resources.gpu_memory_limit (6.00 GiB)" in why
    assert "smallest peak seen" in why and "raise resources.gpu_memory_limit" in why
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[-1].decision is not None and "gpu_memory_limit" in records[-1].decision.why


def test_status_shows_the_attempt_in_flight_with_its_step_and_speed(tmp_path: Path) -> None:
    """While attempt 1 trains, status (text, --json, --follow) names it, its config, step and since when."""
    job = _job(tmp_path, {"default": "ok"})
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("run_scripted.py")), str(job)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "SCRIPTED_CHILD_STEP_S": "0.2"},  # 2 s for the 10 steps
    )
    run = tmp_path / "run"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _heartbeat_seen(run / "attempt-001"):
            time.sleep(0.1)
        text, raw, followed = io.StringIO(), io.StringIO(), io.StringIO()
        status_command([str(run)], out=text)
        status_command([str(run)], as_json=True, out=raw)
        follow = threading.Thread(target=status_command, args=([str(run)], False, True, followed, 0.1))
        follow.start()
        time.sleep(0.8)  # the child beats every 0.2 s: --follow prints each new step
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    follow.join(timeout=30)
    steps = re.findall(r"running: resumed at 0, at step (\d+)", followed.getvalue())
    assert len(set(steps)) >= 2 and not follow.is_alive()  # it moved, and --follow ended with the run
    shown = text.getvalue()
    assert "attempt 1 [train] running: resumed at 0, at step" in shown and "since" in shown
    assert "attempts: 0 (+1 running: attempt 1)" in shown and "micro_batch 4 x accum 2" in shown
    running = json.loads(raw.getvalue())["runs"][0]["running"]
    assert running["attempt"] == 1 and running["step"] >= 1 and running["alive"] is True
    assert running["knobs"]["micro_batch_size"] == 4


def _heartbeat_seen(attempt_dir: Path) -> bool:
    events = attempt_dir / "child-events.jsonl"
    return events.is_file() and '"heartbeat"' in events.read_text()
