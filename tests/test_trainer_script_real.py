"""``trainer.kind: script``: a script with its settings in its code, supervised as written.

The user's script is ``examples/trainers/script/train.py`` (trl's SFTTrainer, as the tutorials write
it) or one of ``tests/fixtures/scripts/`` (transformers' own Trainer, a subclass of it), copied into
the test's folder beside a ``models/llama-2-7b`` link to the tiny model and ``data/train.jsonl``; the
copy is the user's file, checked byte for byte after the run. The OOM is real: torch's
``DefaultCPUAllocator`` under an RLIMIT_DATA cap that lands after step 1 (injected timing).
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from _child import CAPPED_HEADROOM
from _machine import above_baseline, scaled
from _resume_checks import assert_loss_continues, assert_same_samples_per_step, read_lines
from _trainer_configs import text_dataset

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.commands.status import status_command
from qlora_supervise.supervisor.record.journal import read_attempts

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
TUTORIAL = ROOT / "examples" / "trainers" / "script" / "train.py"
FIXTURES = ROOT / "tests" / "fixtures" / "scripts"
#: The tutorial's settings for a 7B, shortened for the tiny model: 3 steps, a checkpoint at step 2.
SHORT = {
    "max_steps=500": "max_steps=3",
    "save_steps=50": "save_steps=2",
    "logging_steps=10": "logging_steps=1",
}
HALVE = {"oom_forward": ["halve_micro_batch"], "oom_backward": ["halve_micro_batch"]}


def _folder(tiny_dir: Path, out: Path, source: Path, changes: dict[str, str]) -> bytes:
    """The user's folder: ``train.py`` (``source`` with ``changes``), the model link and the rows;
    returns the script's bytes."""
    text = source.read_text()
    for old, new in changes.items():
        assert old in text, old
        text = text.replace(old, new)
    (out / "train.py").write_text(text)
    (out / "models").mkdir()
    (out / "models" / "llama-2-7b").symlink_to(tiny_dir / "model")
    (out / "data").mkdir()
    (out / "data" / "train.jsonl").write_bytes((text_dataset(tiny_dir, out) / "train.jsonl").read_bytes())
    return (out / "train.py").read_bytes()


def _job(out: Path, *, capped: bool = True, ladders: dict[str, Any] | None = None) -> Path:
    resources: dict[str, Any] = {"gpu": "cpu"}
    if capped:
        resources["cpu_memory_limit"] = f"{above_baseline(CAPPED_HEADROOM - _GC_SAVES)}B"
    job = {
        "trainer": {"kind": "script", "command": [sys.executable, "train.py"]},
        "resources": resources,
        "supervise": {"hang_timeout": "5m", "backoff_initial": "0.1s", "backoff_max": "1s",
                      "ladders": ladders or HALVE},
        "output_dir": "./run",
    }  # fmt: skip
    (out / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    return out / "job.yaml"


#: The tutorial keeps checkpointing on (prepare_model_for_kbit_training, and SFTConfig's default):
#: micro-batch 16 then needs less than trl's config without it, so the cap sits lower.
_GC_SAVES = 370 * (1 << 20)


def _run(job: Path) -> int:
    return run_job(str(job), plain=True, console=io.StringIO(), install_signals=False)


def _status(run: Path) -> str:
    out = io.StringIO()
    assert status_command([str(run)], out=out) == 0
    return out.getvalue()


def _assert_halved_and_resumed(run: Path, trace: Path, where: str) -> None:
    """Attempt 1 OOMs in step 2 at micro-batch 16 x 1; attempt 2 resumes from step 1 at 8 x 2 (the
    effective batch kept, applied where the script builds its arguments) and reaches step 3."""
    records, bad = read_attempts(run / "attempts.jsonl")
    assert bad == 0 and [r.outcome for r in records] == ["failed", "succeeded"]
    first, second = records
    assert first.failure is not None and first.failure.kind in ("oom_forward", "oom_backward")
    assert "DefaultCPUAllocator" in first.failure.message and "error report" in first.failure.evidence
    assert (first.knobs.micro_batch_size, first.knobs.grad_accum) == (16, 1)  # what the script built
    assert (second.knobs.micro_batch_size, second.knobs.grad_accum) == (8, 2)
    assert second.knobs.effective_batch == first.knobs.effective_batch == 16
    assert first.steps_completed == 1 and second.resumed_from == 1 and second.steps_completed == 3
    assert sum(r.lost_steps for r in records) == 0
    assert_same_samples_per_step(trace)
    assert_loss_continues(run)
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    status = _status(run)
    assert f"per_device_train_batch_size: 16 -> 8 (applied at {where})" in status
    assert f"gradient_accumulation_steps: 1 -> 2 (applied at {where})" in status


def test_a_tutorial_script_that_does_not_fit_finishes_unchanged_under_run(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trl's SFTTrainer script with hard-coded settings OOMs at micro-batch 16; the same command
    finishes at 8 x 2 applied at its SFTConfig, resumed from step 1, the script byte for byte."""
    monkeypatch.setenv("QLORA_SUPERVISE_TEST_CAP_AFTER_STEP", "1")
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("QLORA_SUPERVISE_TEST_TRACE_BATCHES", str(trace))
    script = _folder(tiny_dir, tmp_path, TUTORIAL, SHORT)
    assert _run(_job(tmp_path)) == 0
    _assert_halved_and_resumed(tmp_path / "run", trace, "SFTConfig")
    assert (tmp_path / "train.py").read_bytes() == script
    # The model the script loads, as the journal's (the job named none).
    first = read_attempts(tmp_path / "run" / "attempts.jsonl")[0][0]
    assert first.knobs.model == str(tmp_path / "models" / "llama-2-7b")
    # The script's own output_dir and save_model() landed in the run directory, not beside it.
    assert not (tmp_path / "llama-2-7b-qlora").exists()
    assert (tmp_path / "run" / "trainer-output" / "adapter_model.safetensors").is_file()


@pytest.mark.extended
@pytest.mark.parametrize("name", ["plain_trainer.py", "subclass_trainer.py"])
def test_a_transformers_trainer_script_is_halved_where_it_builds_its_arguments(
    name: str, tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' own Trainer, and a subclass of it: the same halving, at TrainingArguments."""
    monkeypatch.setenv("QLORA_SUPERVISE_TEST_CAP_AFTER_STEP", "1")
    trace = tmp_path / "trace.jsonl"
    monkeypatch.setenv("QLORA_SUPERVISE_TEST_TRACE_BATCHES", str(trace))
    script = _folder(tiny_dir, tmp_path, FIXTURES / name, {})
    assert _run(_job(tmp_path)) == 0
    _assert_halved_and_resumed(tmp_path / "run", trace, "TrainingArguments")
    assert (tmp_path / "train.py").read_bytes() == script


@pytest.mark.extended
def test_a_knob_the_script_sets_after_building_its_trainer_is_named_and_the_ladder_moves_on(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The script puts gradient_accumulation_steps back to 1 after building its Trainer: attempt 2
    says so, keeps 16 x 1 (the effective batch), and attempt 3 takes the next rung instead."""
    monkeypatch.setenv("QLORA_SUPERVISE_TEST_CAP_AFTER_STEP", "1")
    after = (
        "trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)\n"
    )
    changes = {**SHORT, after: f"{after}trainer.args.gradient_accumulation_steps = 1\n"}
    script = _folder(tiny_dir, tmp_path, TUTORIAL, changes)
    ladders = {kind: ["halve_micro_batch", "shorten_seq_len"] for kind in HALVE}
    assert _run(_job(tmp_path, ladders=ladders)) == 0
    run = tmp_path / "run"
    records, _ = read_attempts(run / "attempts.jsonl")
    assert [r.outcome for r in records] == ["failed", "failed", "succeeded"]
    assert set(records[1].unapplied) == {"grad_accum", "micro_batch_size"}
    assert records[1].knobs.effective_batch == 16 and records[1].knobs.micro_batch_size == 16
    assert records[1].decision is not None and records[1].decision.rung == "shorten_seq_len"
    assert records[2].knobs.max_seq_len < 256 and records[2].steps_completed == 3
    status = _status(run)
    late = "gradient_accumulation_steps: 1 (not applied: the script sets it to 1 after building its Trainer"
    assert late in status
    assert "per_device_train_batch_size: 16 (not applied: put back as the script asked" in status
    assert (tmp_path / "train.py").read_bytes() == script


def _heartbeat_step(events: Path) -> int:
    if not events.is_file():
        return 0
    return max(
        (int(e.get("step") or 0) for e in read_lines(events) if e.get("event") == "heartbeat"), default=0
    )


@pytest.mark.extended
def test_sigterm_then_the_same_command_resumes_the_script_from_its_newest_checkpoint(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """SIGTERM to the supervisor: the script's Trainer checkpoints its step and exits 143; the same
    command again resumes it there and trains every step once, with the same samples per step."""
    steps = 40
    changes = {"max_steps=500": f"max_steps={steps}", "save_steps=50": "save_steps=1000",
               "per_device_train_batch_size=16": "per_device_train_batch_size=4",
               "max_length=256": "max_length=128"}  # fmt: skip
    script = _folder(tiny_dir, tmp_path, TUTORIAL, changes)
    job = _job(tmp_path, capped=False)
    trace = tmp_path / "trace.jsonl"
    env = {**os.environ, "QLORA_SUPERVISE_TEST_TRACE_BATCHES": str(trace)}
    cli = [sys.executable, "-m", "qlora_supervise.supervisor.commands.cli", "run", str(job), "--plain"]
    proc = subprocess.Popen(cli, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
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
    stopped = read_attempts(tmp_path / "run" / "attempts.jsonl")[0][-1]
    assert stopped.outcome == "stopped" and stopped.lost_steps == 0
    assert 1 <= stopped.next_resume_from < steps
    done = subprocess.run(cli, env=env, capture_output=True, timeout=scaled(600))
    assert done.returncode == 0, done.stderr[-2000:]
    last = read_attempts(tmp_path / "run" / "attempts.jsonl")[0][-1]
    assert last.outcome == "succeeded" and last.resumed_from == stopped.next_resume_from
    assert last.steps_completed == steps
    # Each step's rows once, and the resumed steps' rows those an unbroken run draws: the step
    # numbers follow on, none repeated, four rows each.
    batches = read_lines(trace)
    assert [b["step"] for b in batches] == list(range(1, steps + 1))
    rows = [r for b in batches for r in b["rows"]]
    assert all(len(b["rows"]) == 4 for b in batches) and len(rows) == len(set(rows))
    assert (tmp_path / "train.py").read_bytes() == script
