"""The real trainer child on the tiny model (issue 11, items 2, 3, 4, 7, 8, 14): checkpoints that
do not load, unmarked directories in the way, a checkpoint without optimizer state, a GPU that is
not there, bad records, and the started event. Each damage is done to real checkpoint files."""

from __future__ import annotations

import io
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from _child import events, log_tail, make_spec, report, run_child

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.trainer_child.contract.checkpoints import (
    CHECKPOINT_COMPLETE_MARKER,
    complete_checkpoints,
)
from qlora_supervise.trainer_child.contract.codes import ExitCode

pytestmark = pytest.mark.slow
SCHEDULE = {"max_steps": 6, "save_steps": 2, "warmup_ratio": 0.5, "learning_rate": 2e-3}


def _learning_rates(child_log: Path) -> list[float]:
    """The learning rate Trainer logged at each step (logging_steps 1), in order."""
    return [float(x) for x in re.findall(r"'learning_rate': '?([0-9.e+-]+)'?", child_log.read_text())]


def _job(tiny_dir: Path, tmp_path: Path, **resources: Any) -> Path:
    """The tiny job with make_spec's knobs and SCHEDULE, on the CPU unless told."""
    job = yaml.safe_load((tiny_dir / "job.yaml").read_text())
    job["model"]["path"] = str(tiny_dir / "model")
    job["data"]["path"] = str(tiny_dir / "data.jsonl")
    job["train"].update(
        micro_batch_size=2, effective_batch_size=8, max_seq_len=128, logging_steps=1, **SCHEDULE
    )
    job["resources"] = {"gpu": "cpu", **resources}
    job["supervise"] = {"hang_timeout": "5m", "backoff_initial": "0.1s", "backoff_max": "1s"}
    job["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    return path


def _old_marker(checkpoint: Path) -> None:
    """Rewrite the marker as markers were before they listed files (no sizes, no checksums)."""
    marker_path = checkpoint / CHECKPOINT_COMPLETE_MARKER
    marker = json.loads(marker_path.read_text())
    del marker["files"]
    marker_path.write_text(json.dumps(marker))


def test_undetected_damage_fails_to_load_is_quarantined_and_the_older_checkpoint_resumes_with_its_schedule(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Items 2 and 4: checkpoint-4 (old marker) has a corrupt trainer_state.json: the child reports
    checkpoint_damaged, the supervisor quarantines it and resumes checkpoint-2, which lacks optimizer.pt
    and scheduler.pt: a journaled optimizer reset whose learning rates follow the step."""
    reference = make_spec(tiny_dir, tmp_path / "reference", train=SCHEDULE)
    assert run_child(reference) == ExitCode.OK, log_tail(reference)
    expected = _learning_rates(Path(reference.events_file).parent / "child.log")
    assert len(expected) == 6
    made = dict(complete_checkpoints(reference.checkpoints_dir))
    files = json.loads((made[2] / CHECKPOINT_COMPLETE_MARKER).read_text())["files"]
    adapter = made[2] / "adapter_model.safetensors"
    assert files["adapter_model.safetensors"]["size"] == adapter.stat().st_size
    assert len(files["adapter_model.safetensors"]["sha256"]) == 64 and "optimizer.pt" in files

    job = _job(tiny_dir, tmp_path)
    checkpoints = tmp_path / "run" / "checkpoints"
    # A run of ours killed before its first journal entry: its event log, then these checkpoints.
    checkpoints.mkdir(parents=True)
    (tmp_path / "run" / "events.jsonl").write_text('{"event": "run_started", "level": "info"}\n')
    for step in (2, 4):
        shutil.copytree(made[step], checkpoints / f"checkpoint-{step}")
        _old_marker(checkpoints / f"checkpoint-{step}")
    (checkpoints / "checkpoint-4" / "trainer_state.json").write_text('{"global_step": 4, "log_hist')
    (checkpoints / "checkpoint-2" / "optimizer.pt").unlink()
    (checkpoints / "checkpoint-2" / "scheduler.pt").unlink()

    assert run_job(str(job), plain=True, console=io.StringIO(), install_signals=False) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    first, second = records
    assert first.failure is not None and first.failure.kind == "checkpoint_damaged"
    assert first.exit_code == ExitCode.CHECKPOINT and first.decision is not None
    assert first.decision.rung == "quarantine_checkpoint" and first.next_resume_from == 2
    assert (tmp_path / "run" / "checkpoints-quarantine" / "checkpoint-4" / "trainer_state.json").exists()
    assert second.resumed_from == 2 and second.steps_completed == 6 and second.outcome == "succeeded"
    assert second.optimizer_reset is not None and "no optimizer state" in second.optimizer_reset
    logged = read_events(tmp_path / "run" / "events.jsonl")
    assert any(e["event"] == "checkpoint_quarantined" and e["checkpoint"] == "checkpoint-4" for e in logged)
    assert any(e["event"] == "optimizer_reset" for e in logged)
    resumed = _learning_rates(tmp_path / "run" / "attempt-002" / "child.log")
    assert resumed == pytest.approx(expected[2:], rel=1e-6), (
        "the LR schedule restarted instead of following the step"
    )


def test_an_unmarked_checkpoint_directory_does_not_block_the_save_of_its_step(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Item 3: a checkpoint-2 without marker (and an unmarked checkpoint-9) are moved to the
    quarantine folder; the saves of steps 2 and 4 succeed instead of failing on 'Directory not empty'."""
    spec = make_spec(tiny_dir, tmp_path, train={"max_steps": 4, "save_steps": 2})
    for leftover in ("checkpoint-2", "checkpoint-9"):
        (tmp_path / "checkpoints" / leftover).mkdir(parents=True)
        (tmp_path / "checkpoints" / leftover / "adapter_model.safetensors").write_text("half a file")
    assert run_child(spec) == ExitCode.OK, log_tail(spec)
    assert [step for step, _ in complete_checkpoints(spec.checkpoints_dir)] == [2, 4]
    assert not (tmp_path / "checkpoints" / "checkpoint-9").exists()
    quarantine = tmp_path / "checkpoints-quarantine"
    assert sorted(p.name for p in quarantine.iterdir()) == ["checkpoint-2", "checkpoint-9"]
    assert (quarantine / "checkpoint-2" / "adapter_model.safetensors").read_text() == "half a file"


def test_a_requested_gpu_that_is_not_there_is_a_config_error_not_a_cpu_run(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Item 7: gpu: 0 on this machine (no GPU) exits 4 with the reason, instead of training on the CPU."""
    job = _job(tiny_dir, tmp_path, gpu=0, gpu_memory_limit="1GiB")
    assert run_job(str(job), plain=True, console=io.StringIO(), install_signals=False) == 4
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert len(records) == 1 and records[0].steps_completed == 0
    failure = records[0].failure
    assert failure is not None and failure.kind == "config_error" and failure.stage == "setup"
    assert "resources.gpu 'cuda:0': no usable GPU" in failure.message
    assert any(why in failure.message for why in ("built without CUDA", "driver", "no such GPU"))
    assert not (tmp_path / "run" / "adapter").exists()


def test_a_null_record_mid_file_is_a_config_error_naming_its_line_and_started_names_trust_remote_code(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Items 8 and 14: a null text on line 5 exits 71 naming file, line and field; the started event
    says trust_remote_code, and stderr warns of it."""
    rows = (tiny_dir / "data.jsonl").read_text().splitlines()
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join([*rows[:4], '{"text": null}', *rows[4:]]) + "\n")
    spec = make_spec(tiny_dir, tmp_path, data={"path": str(data)}, train={"trust_remote_code": True})
    assert run_child(spec) == ExitCode.CONFIG, log_tail(spec)
    failure = report(spec)
    assert failure.config_error and "bad.jsonl line 5, field 'text': null, expected text" in failure.message
    started = next(e for e in events(spec) if e["event"] == "started")
    assert started["trust_remote_code"] is True
    assert "trust_remote_code is on" in log_tail(spec)
