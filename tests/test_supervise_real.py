"""The supervisor over the real trainer child on the tiny model, under real CPU memory caps.

The cap is ``RLIMIT_DATA``: the child's allocations fail inside torch with
``DefaultCPUAllocator: can't allocate memory``, a genuine out-of-memory. Micro-batch 16 at
seq 512 without gradient checkpointing needs about 1.7 GiB of data segment on the tiny model,
with checkpointing about 1.2 GiB; the 1350 MiB cap sits between them.
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
from _child import capped_job
from _machine import scaled

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts

pytestmark = pytest.mark.slow
#: Each step is micro-batch 16 at seq 512 on the CPU; six leave the kill (at attempt 2's step 2)
#: and the successor's reclaim of the orphaned trainer well inside the run.
MAX_STEPS = 6


def _job(tiny_dir: Path, tmp_path: Path, **train: Any) -> Path:
    return capped_job(tiny_dir, tmp_path, max_steps=MAX_STEPS, save_steps=4, **train)


def _run(job: Path) -> int:
    return run_job(str(job), plain=True, console=io.StringIO(), install_signals=False)


def test_real_oom_mid_run_is_retried_and_loses_no_step(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real forward OOM at step 3 restarts with checkpointing from the emergency checkpoint of step 2."""
    # Injected timing, real failure: the child applies its cap only after step 2, so the OOM
    # comes mid-run (where an emergency checkpoint is possible) rather than at the first step.
    # Four steps, not eight: each is micro-batch 16 at seq 512 on the CPU, and the resume is the same.
    monkeypatch.setenv("QLORA_SUPERVISE_TEST_CAP_AFTER_STEP", "2")
    steps = 4
    assert _run(capped_job(tiny_dir, tmp_path, max_steps=steps, save_steps=4)) == 0
    run = tmp_path / "run"
    records, bad = read_attempts(run / "attempts.jsonl")
    assert bad == 0
    first, last = records[0], records[-1]
    assert first.outcome == "failed" and last.outcome == "succeeded"
    assert first.failure is not None
    assert first.failure.kind in ("oom_forward", "oom_backward")
    assert first.failure.stage in ("forward", "backward")
    assert first.failure.numbers["tried_to_allocate"] > 0
    assert first.failure.emergency_checkpoint
    assert first.steps_completed == 2 and first.next_resume_from == 2
    assert first.decision is not None and first.decision.changes == {"gradient_checkpointing": (False, True)}
    assert all(r.knobs.micro_batch_size * r.knobs.grad_accum == 16 for r in records)
    assert last.resumed_from == 2 and last.steps_completed == steps
    assert sum(r.lost_steps for r in records) == 0
    assert (run / "adapter" / "adapter_config.json").exists()
    trainer_state = json.loads(
        (run / "checkpoints" / f"checkpoint-{steps}" / "trainer_state.json").read_text()
    )
    assert trainer_state["global_step"] == steps
    retry = next(e for e in read_events(run / "events.jsonl") if e["event"] == "retry")
    assert retry["emergency_checkpoint"] is True and retry["lost_steps"] == 0


def _wait_for(predicate: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def _heartbeat_step(events_file: Path) -> int:
    if not events_file.exists():
        return 0
    steps = [
        json.loads(line).get("step") or 0 for line in events_file.read_text().splitlines() if line.strip()
    ]
    return max(steps, default=0)


def test_supervisor_sigkill_then_same_command_finishes_without_repeating_failed_config(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """SIGKILL of the supervisor mid-attempt, then the same command: it finishes, no failed config reruns."""
    job = _job(tiny_dir, tmp_path)
    command = [sys.executable, "-m", "qlora_supervise.supervisor.commands.cli", "run", "--plain", str(job)]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    second = tmp_path / "run" / "attempt-002" / "child-events.jsonl"
    try:
        _wait_for(lambda: _heartbeat_step(second) >= 2, timeout=scaled(240))  # generous, scaled
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    assert _run(job) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[0].outcome == "failed" and records[0].failure is not None
    assert records[0].failure.kind == "oom_forward"
    # The supervisor died under attempt 2, so its successor reclaimed it: interrupted (no verdict),
    # never "stopped" (that is a stop signal the supervisor itself saw through).
    assert records[1].attempt == 2 and records[1].outcome == "interrupted"
    assert all(r.knobs != records[0].knobs for r in records[1:])
    assert records[-1].outcome == "succeeded" and records[-1].steps_completed == MAX_STEPS
    assert records[-1].resumed_from >= 2


def test_target_modules_matching_nothing_stops_with_exit_2_before_any_attempt(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """A job whose LoRA targets match no layer is refused before any attempt (exit 2) with the layer names.

    Issue 11 item 10 moved this check from the child (exit 4 after loading the model) to the job
    file's validation, which reads the tensor names from the safetensors header; the child's own
    check stays (tests/test_child_train.py).
    """
    job = _job(tiny_dir, tmp_path)
    raw = yaml.safe_load(job.read_text())
    raw["lora"]["target_modules"] = ["query_key_value"]
    job.write_text(yaml.safe_dump(raw))
    out = subprocess.run(
        [sys.executable, "-m", "qlora_supervise.supervisor.commands.cli", "run", "--plain", str(job)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        check=False,
    )
    assert out.returncode == 2, out.stderr[-2000:]
    assert "lora.target_modules" in out.stderr and "'query_key_value' match no layer" in out.stderr
    assert "q_proj" in out.stderr  # the message lists the linear layers the model has
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert len(records) == 0


def test_merge_runs_in_its_own_process_after_training(tiny_dir: Path, tmp_path: Path) -> None:
    """With train.merge the adapter is merged in a separate merge attempt after training finishes."""
    job = _job(tiny_dir, tmp_path, merge=True)
    raw = yaml.safe_load(job.read_text())
    # Effective batch 2 (not the capped job's 16): the same path at an eighth of the compute.
    raw["train"].update(
        micro_batch_size=1, effective_batch_size=2, max_steps=2, save_steps=2, max_seq_len=128
    )
    raw["resources"] = {"gpu": "cpu"}
    job.write_text(yaml.safe_dump(raw))
    assert _run(job) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert [(r.phase, r.outcome) for r in records] == [("train", "succeeded"), ("merge", "succeeded")]
    merged = tmp_path / "run" / "merged"
    assert (merged / "config.json").exists()
    assert any(merged.glob("*.safetensors"))
    assert _run(job) == 0  # a finished run stays finished


def test_evaluation_runs_through_the_real_4bit_path(tiny_dir: Path, tmp_path: Path) -> None:
    """An eval split evaluates every eval_steps (stage eval in the heartbeats) and the run finishes."""
    job = _job(tiny_dir, tmp_path)
    raw = yaml.safe_load(job.read_text())
    raw["data"]["eval_fraction"] = 0.1
    raw["train"].update(
        micro_batch_size=1, effective_batch_size=2, max_steps=4, save_steps=2, eval_steps=2, max_seq_len=128
    )  # effective batch 2, not the capped job's 16: the same path at an eighth of the compute
    raw["resources"] = {"gpu": "cpu"}
    job.write_text(yaml.safe_dump(raw))
    assert _run(job) == 0
    events = (tmp_path / "run" / "attempt-001" / "child-events.jsonl").read_text().splitlines()
    stages = {json.loads(line).get("stage") for line in events}
    assert "eval" in stages
