"""The supervisor loop with scripted children: real processes, injected faults, seconds per test.

One real-process test per behaviour; the bookkeeping (ladders, budgets, waits, journal lines) runs
on the fake clock in ``test_loop_fake_clock.py``.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from _cli import cli

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts, read_state

sys.path.insert(0, str(Path(__file__).parent))
from run_scripted import FakeGpu, scripted_seams

MAX_STEPS = 10


def _job(
    tmp_path: Path,
    plan: dict[str, str],
    resources: dict[str, Any] | None = None,
    train: dict[str, Any] | None = None,
    **supervise: Any,
) -> Path:
    """A valid job for a fake model dir, and the scripted child's plan."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(20)))
    job = {
        "model": {"path": "model"},
        "data": {"path": "data.jsonl"},
        "train": {
            "micro_batch_size": 4,
            "effective_batch_size": 8,
            "gradient_checkpointing": False,
            "max_steps": MAX_STEPS,
            "save_steps": 4,
            "max_seq_len": 256,
            **(train or {}),
        },
        "resources": {"gpu": "cpu", **(resources or {})},
        "supervise": {"hang_timeout": "2s", "backoff_initial": "0.05s", "backoff_max": "0.2s", **supervise},
        "output_dir": "run",
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    # Undone after each test by conftest's _test_process_state (a monkeypatch of this variable).
    os.environ["SCRIPTED_CHILD_PLAN"] = str(plan_path)
    return path


def _plan(tmp_path: Path, plan: dict[str, str]) -> None:
    """Change the scripted child's plan between two runs of the same job."""
    (tmp_path / "plan.json").write_text(json.dumps(plan))


def _run(job: Path) -> int:
    return run_job(str(job), plain=True, seams=scripted_seams(), console=io.StringIO(), install_signals=False)


def _events(tmp_path: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == name]


def test_forward_oom_is_retried_with_checkpointing_and_loses_no_step(tmp_path: Path) -> None:
    """A forward OOM at step 3 restarts with gradient checkpointing from the emergency checkpoint."""
    code = _run(_job(tmp_path, {"1": "oom_forward@3"}))
    assert code == 0
    records, bad = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert bad == 0 and [r.outcome for r in records] == ["failed", "succeeded"]
    first, second = records
    assert first.failure is not None and first.failure.kind == "oom_forward"
    assert first.failure.stage == "forward"
    assert first.decision is not None and first.decision.rung == "gradient_checkpointing"
    assert first.decision.changes == {"gradient_checkpointing": (False, True)}
    assert first.steps_completed == 2 and first.next_resume_from == 2 and first.lost_steps == 0
    assert second.resumed_from == 2 and second.steps_completed == MAX_STEPS
    assert second.knobs.micro_batch_size * second.knobs.grad_accum == 8
    retry = _events(tmp_path, "retry")[0]
    assert retry["failed"] == "oom_forward" and retry["lost_steps"] == 0
    assert retry["numbers"]["tried_to_allocate"] == 2 * 1024**3
    assert _events(tmp_path, "run_succeeded")
    assert read_state(tmp_path / "run" / "state.json").run_state.value == "succeeded"  # type: ignore[union-attr]


def test_fragmentation_sets_expandable_segments_in_the_child_env(tmp_path: Path) -> None:
    """An OOM with large reserved-but-unallocated memory restarts with expandable_segments."""
    # Expandable segments are on by default; this job turns them off to see the rung put them back.
    assert _run(_job(tmp_path, {"1": "fragmentation@3"}, resources={"expandable_segments": False})) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[0].failure is not None and records[0].failure.kind == "oom_fragmentation"
    assert records[0].decision is not None and records[0].decision.rung == "expandable_segments"
    assert records[1].knobs.expandable_segments is True


def test_hung_child_is_stopped_and_restarted(tmp_path: Path) -> None:
    """A child whose step stops advancing for hang_timeout is killed, classified hang, and retried."""
    started = time.monotonic()
    assert _run(_job(tmp_path, {"1": "hang@3"})) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[0].failure is not None and records[0].failure.kind == "hang"
    assert records[0].decision is not None and records[0].decision.rung == "retry_unchanged"
    assert records[1].outcome == "succeeded"
    assert _events(tmp_path, "hang_detected")
    assert time.monotonic() - started < 30


def test_sigkill_with_cgroup_oom_evidence_is_host_oom(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child SIGKILLed while the cgroup's oom_kill counter rises is classified host_oom."""
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    monkeypatch.setenv("QLORA_SUPERVISE_CGROUP_MEMORY_EVENTS", str(events))
    monkeypatch.setenv("SCRIPTED_CHILD_OOM_EVENTS", str(events))
    assert _run(_job(tmp_path, {"1": "sigkill@3"})) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[0].signal == signal.SIGKILL
    assert records[0].failure is not None and records[0].failure.kind == "host_oom"


def test_config_error_stops_at_once_with_exit_4(tmp_path: Path) -> None:
    """A config error in the child is never retried: exit 4 after one attempt, with the reason logged."""
    assert _run(_job(tmp_path, {"1": "config_error"})) == 4
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert len(records) == 1
    gave_up = _events(tmp_path, "gave_up")[0]
    assert gave_up["failed"] == "config_error"
    assert "target_modules" in gave_up["message"]
    assert _run(tmp_path / "job.yaml") == 4  # a finished verdict is not re-run


def _spawn_supervisor(job: Path) -> subprocess.Popen[bytes]:
    runner = Path(__file__).with_name("run_scripted.py")
    return subprocess.Popen([sys.executable, str(runner), str(job)], stderr=subprocess.PIPE)


def _wait_for(predicate: Any, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_sigterm_stops_gracefully_and_the_same_command_resumes(tmp_path: Path) -> None:
    """SIGTERM makes the child checkpoint, the supervisor exits 143, and rerunning finishes the run."""
    job = _job(tmp_path, {"default": "slow"})
    proc = _spawn_supervisor(job)
    events = tmp_path / "run" / "attempt-001" / "child-events.jsonl"
    _wait_for(lambda: events.exists() and events.read_text().count('"heartbeat"') >= 2)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[-1].outcome == "stopped" and records[-1].next_resume_from and records[-1].lost_steps == 0
    # Bug 6: the step the child finished after our SIGTERM, before its checkpoint, is counted.
    assert records[-1].steps_completed == records[-1].next_resume_from
    assert read_state(tmp_path / "run" / "state.json").run_state.value == "stopped"  # type: ignore[union-attr]
    _plan(tmp_path, {"default": "ok"})  # the rest of the run need not be slow
    assert _run(job) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[-1].outcome == "succeeded" and records[-1].resumed_from == records[-2].next_resume_from


@pytest.mark.usefixtures("reaps_orphans")
def test_supervisor_sigkill_mid_attempt_resumes_without_repeating_failed_config(tmp_path: Path) -> None:
    """A supervisor SIGKILLed mid-attempt and started again finishes without rerunning a failed config."""
    job = _job(tmp_path, {"1": "oom_forward@2", "default": "slow"})
    proc = _spawn_supervisor(job)
    events = tmp_path / "run" / "attempt-002" / "child-events.jsonl"
    _wait_for(lambda: events.exists() and '"heartbeat"' in events.read_text())
    proc.kill()
    proc.wait(timeout=10)
    _plan(tmp_path, {"1": "oom_forward@2", "default": "ok"})  # the rest of the run need not be slow
    assert _run(job) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    # Attempt 2 was reclaimed: its child (stopped by PDEATHSIG, or by the reclaim) left no report,
    # so it is interrupted, no verdict on its config; attempt 3 finishes.
    assert [r.outcome for r in records] == ["failed", "interrupted", "succeeded"]
    failed_config = records[0].knobs
    assert all(r.knobs != failed_config for r in records[1:])
    assert records[-1].steps_completed == MAX_STEPS


def _run_with_gpu(job: Path, gpu: FakeGpu) -> int:
    seams = scripted_seams()
    seams.open_gpu = lambda device: gpu  # type: ignore[assignment,return-value]
    return run_job(str(job), plain=True, seams=seams, console=io.StringIO(), install_signals=False)


def test_contention_waits_for_memory_then_restarts_unchanged(tmp_path: Path) -> None:
    """An OOM caused by another process waits for the memory to come back, then retries the same config."""
    gpu = FakeGpu(frees_after=3)
    assert _run_with_gpu(_job(tmp_path, {"1": "contention@3"}, contention_wait="30s"), gpu) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[0].failure is not None and records[0].failure.kind == "oom_contention"
    assert records[0].decision is not None and records[0].decision.rung == "wait_for_memory"
    assert records[1].knobs == records[0].knobs
    waiting = _events(tmp_path, "waiting_for_memory")[0]
    assert waiting["numbers"]["processes"] == {"4242": 18 * 1024**3}  # JSON keys are strings
    assert _events(tmp_path, "memory_available")
    assert gpu.polls >= 3


def test_status_tells_the_retry_story(tmp_path: Path) -> None:
    """`qlora-supervise status` prints each attempt's config, failure, change and lost steps."""
    assert _run(_job(tmp_path, {"1": "oom_backward@3"})) == 0
    done = cli("status", str(tmp_path / "run"))  # main() in-process: the words are the point
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "state: succeeded" in out
    assert "failed: oom_backward in backward" in out
    assert "retry: gradient_checkpointing: gradient_checkpointing False -> True" in out
    assert "next attempt resumes at step 2, lost 0 step(s)" in out
    assert "attempts: 2, lost steps in total: 0" in out


def test_status_of_a_directory_that_is_no_run_fails_clearly(tmp_path: Path) -> None:
    """`status` on a directory without a journal exits 2 and names the problem."""
    out = cli("status", str(tmp_path))
    assert out.returncode == 2
    assert "is not a run directory" in out.stderr


def test_sigterm_during_the_contention_wait_stops_resumably(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stop signal while waiting for another process's memory exits 143 and leaves the run resumable."""
    job = _job(tmp_path, {"1": "contention@3"}, contention_wait="10m")
    monkeypatch.setenv("SCRIPTED_GPU_NEVER_FREES", "1")
    proc = _spawn_supervisor(job)
    _wait_for(
        lambda: any(
            e["event"] == "waiting_for_memory" for e in read_events(tmp_path / "run" / "events.jsonl")
        )
    )
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 143
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[-1].outcome == "stopped"
    assert read_state(tmp_path / "run" / "state.json").run_state.value == "stopped"  # type: ignore[union-attr]
    monkeypatch.delenv("SCRIPTED_GPU_NEVER_FREES")
    assert _run(job) == 0  # the same command resumes and finishes


def test_optimizer_change_resets_the_optimizer_state_from_the_checkpoint_itself(tmp_path: Path) -> None:
    """After the paged-8-bit rung, every attempt resuming an old-optimizer checkpoint resets its optimizer."""
    job = _job(tmp_path, {"1": "oom_backward@3", "2": "oom_backward@3", "3": "oom_backward@3"})
    raw = yaml.safe_load(job.read_text())
    raw["train"]["optimizer"] = "adamw_torch"
    job.write_text(yaml.safe_dump(raw))
    assert _run(job) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    rungs = [r.decision.rung for r in records if r.decision]
    assert rungs[:2] == ["gradient_checkpointing", "paged_8bit_optimizer"]
    specs = [json.loads((tmp_path / "run" / f"attempt-{n:03d}" / "spec.json").read_text()) for n in (3, 4)]
    # attempts 3 and 4 both resume checkpoint-2, written by attempt 1 with adamw_torch
    assert all(s["knobs"]["optimizer"] == "paged_adamw_8bit" for s in specs)
    assert all(s["resume_from"].endswith("checkpoint-2") and s["reset_optimizer"] for s in specs)


def test_pids_running_finds_a_child_by_its_spec_path(tmp_path: Path) -> None:
    """An orphan whose pid was never recorded is found by the spec path on its command line."""
    from qlora_supervise.supervisor.loop.child import pids_running

    marker = str(tmp_path / "attempt-007" / "spec.json")
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    try:
        _wait_for(lambda: proc.pid in pids_running(marker), timeout=10)
    finally:
        proc.kill()
        proc.wait()
    assert proc.pid not in pids_running(marker)


def test_two_trainer_deaths_with_progress_between_do_not_end_the_run(tmp_path: Path) -> None:
    """Issue 11 item 1: a child SIGKILLed at steps 3 and 7 (no OOM sign: `other`) is retried and finishes."""
    assert _run(_job(tmp_path, {"1": "killed@3", "2": "killed@7"})) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert [r.signal for r in records[:2]] == [signal.SIGKILL, signal.SIGKILL]
    assert [r.failure.kind for r in records if r.failure] == ["other", "other"]
    assert [r.decision.rung for r in records if r.decision] == ["retry_unchanged", "retry_unchanged"]
    assert records[-1].outcome == "succeeded" and records[-1].steps_completed == MAX_STEPS
