"""``trl sft`` itself, supervised on the tiny model under a real CPU memory cap (RLIMIT_DATA).

The child is trl's own script (``python -m trl.scripts.sft --config attempt-NNN/trl-sft.yaml``)
with the shim on its PYTHONPATH: the OOM is torch's own ``DefaultCPUAllocator: can't allocate
memory`` in trl's forward, the report and the emergency checkpoint come from the shim, the new
knobs reach trl through the per-attempt config only.
"""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from _machine import scaled
from _resume_checks import assert_loss_continues, assert_same_samples_per_step, read_lines
from _trainer_configs import trl_job

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.commands.status import status_command
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts

pytestmark = pytest.mark.slow


def _run(job: Path) -> int:
    return run_job(str(job), plain=True, console=io.StringIO(), install_signals=False)


def test_trl_sft_oom_restarts_with_half_the_micro_batch_and_resumes_in_order(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real forward OOM in trl at step 2 resumes from step 1 at micro-batch 8 x 2, same samples."""
    # Injected timing, real failure: the cap lands after step 1, so step 2's forward runs out.
    monkeypatch.setenv("QLORA_SUPERVISE_TEST_CAP_AFTER_STEP", "1")
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("QLORA_SUPERVISE_TEST_TRACE_BATCHES", str(trace))
    # save_steps 2: the step-1 checkpoint it resumes from is the shim's emergency save.
    job = trl_job(
        tiny_dir, tmp_path, save_steps=2, supervise={"ladders": {"oom_forward": ["halve_micro_batch"]}}
    )
    user_file = (tmp_path / "sft.yaml").read_text()
    assert _run(job) == 0
    run = tmp_path / "run"
    records, bad = read_attempts(run / "attempts.jsonl")
    assert bad == 0 and [r.outcome for r in records] == ["failed", "succeeded"]
    first, second = records
    assert first.failure is not None and first.failure.kind == "oom_forward"
    assert first.failure.stage == "forward" and "error report" in first.failure.evidence
    assert first.steps_completed == 1 and second.resumed_from == 1 and second.steps_completed == 3
    assert first.failure.emergency_checkpoint == str(run / "checkpoints" / "checkpoint-1")
    assert (second.knobs.micro_batch_size, second.knobs.grad_accum) == (8, 2)
    assert second.knobs.effective_batch == first.knobs.effective_batch == 16
    # The new knobs reached trl through attempt 2's own config; the user's file is untouched.
    config = yaml.safe_load((run / "attempt-002" / "trl-sft.yaml").read_text())
    assert config["per_device_train_batch_size"] == 8 and config["gradient_accumulation_steps"] == 2
    assert config["resume_from_checkpoint"] == str(run / "checkpoints" / "checkpoint-1")
    assert config["a_key_we_do_not_know"] == {"kept": [1, 2]}
    assert (tmp_path / "sft.yaml").read_text() == user_file
    # Data order and loss continuity across the resume (tests/_resume_checks.py).
    assert_same_samples_per_step(trace)
    assert_loss_continues(run)
    events = [e["event"] for e in read_events(run / "events.jsonl")]
    assert "shim_not_attached" not in events
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    out = io.StringIO()
    assert status_command([str(run)], out=out) == 0
    assert "per_device_train_batch_size: 16 -> 8; gradient_accumulation_steps: 1 -> 2" in out.getvalue()


def _heartbeat_step(events: Path) -> int:
    if not events.is_file():
        return 0
    beats = [e for e in read_lines(events) if e.get("event") == "heartbeat"]
    return max((int(b.get("step") or 0) for b in beats), default=0)


_STEPS = 60


def test_sigterm_stops_trl_at_a_checkpoint_and_the_same_command_resumes_it(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """SIGTERM to the supervisor: trl finishes its step, the shim checkpoints it, exit 143; rerun finishes."""
    job = trl_job(tiny_dir, tmp_path, capped=False, per_device_train_batch_size=4, max_length=128,
                  max_steps=_STEPS, save_steps=1000)  # fmt: skip
    cli = [sys.executable, "-m", "qlora_supervise.supervisor.commands.cli", "run", str(job), "--plain"]
    proc = subprocess.Popen(cli, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        events = tmp_path / "run" / "attempt-001" / "child-events.jsonl"
        deadline = time.monotonic() + scaled(120)
        while _heartbeat_step(events) < 1:
            assert proc.poll() is None and time.monotonic() < deadline, "no step within the time"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=scaled(60)) == 143
    finally:
        if proc.poll() is None:
            proc.kill()
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    stopped = records[-1]
    assert stopped.outcome == "stopped" and stopped.lost_steps == 0
    # A checkpoint of the stop: save_steps would not have made one. The run is long enough that a
    # fast machine cannot finish it between our SIGTERM and the supervisor's next tick (0.5 s).
    assert 1 <= stopped.next_resume_from < _STEPS, stopped.next_resume_from
    assert _run(job) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[-1].outcome == "succeeded" and records[-1].resumed_from == stopped.next_resume_from
    assert records[-1].steps_completed == _STEPS


def test_a_config_trl_refuses_at_load_is_a_config_error_tried_once(tiny_dir: Path, tmp_path: Path) -> None:
    """No dataset_name: trl's script raises ValueError before any Trainer exists. The shim's report
    marks it the config's (it would fail alike on every start): one attempt, exit 4, the message."""
    job = trl_job(tiny_dir, tmp_path, capped=False)
    config = yaml.safe_load((tmp_path / "sft.yaml").read_text())
    del config["dataset_name"]
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    assert _run(job) == 4
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert len(records) == 1 and records[0].failure is not None
    failure = records[0].failure
    assert failure.kind == "config_error" and failure.stage == "load" and "error report" in failure.evidence
    assert failure.message.startswith("ValueError") and "dataset_name" in failure.message
