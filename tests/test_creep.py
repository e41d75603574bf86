"""Memory creep: a leak seen in heartbeats, the early checkpoint it asks for, and no step lost."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.loop.child import Seams
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.supervisor.watching.watch import HORIZON_STEPS, CreepWatch
from qlora_supervise.trainer_child.contract.codes import Stage
from qlora_supervise.trainer_child.contract.events import ChildPeakSource, Heartbeat, MemoryNumbers

sys.path.insert(0, str(Path(__file__).parent))
from _machine import import_baseline
from run_scripted import scripted_seams

MIB, GIB = 1024**2, 1024**3


def _beat(step: int, peak: int, source: ChildPeakSource = ChildPeakSource.CUDA_ALLOCATOR) -> Heartbeat:
    return Heartbeat(Stage.FORWARD, step, memory=MemoryNumbers(peak_bytes=peak, peak_source=source))


def _feed(watch: CreepWatch, peaks: list[int]) -> list[Any]:
    return [f for step, peak in enumerate(peaks, start=1) if (f := watch.observe(_beat(step, peak)))]


def test_a_peak_rising_every_step_towards_the_budget_is_forecast_once() -> None:
    """+100 MiB a step towards 2 GiB: one forecast, with the slope and the step the budget is reached."""
    watch = CreepWatch(gpu_budget=2 * GIB, cpu_budget=None)
    forecasts = _feed(watch, [GIB + step * 100 * MIB for step in range(1, 20)])
    assert len(forecasts) == 1
    forecast = forecasts[0]
    assert abs(forecast.slope_bytes_per_step - 100 * MIB) < MIB
    steps_left = -(-(2 * GIB - forecast.peak_bytes) // (100 * MIB))
    assert forecast.predicted_oom_step == forecast.step + steps_left
    assert forecast.predicted_oom_step - forecast.step <= HORIZON_STEPS and forecast.asks_for_checkpoint


def test_a_flat_or_jumping_peak_is_no_creep() -> None:
    """A plateau, noise below the floor, and a few record batches are what healthy runs show."""
    flat = [5 * GIB] * 20
    noisy = [5 * GIB + (step % 3) * MIB for step in range(20)]
    records = [
        5 * GIB,
        5 * GIB,
        6 * GIB,
        6 * GIB,
        6 * GIB,
        6 * GIB + 300 * MIB,
        *[6 * GIB + 300 * MIB] * 6,
        7 * GIB,
    ]
    for peaks in (flat, noisy, records):
        assert _feed(CreepWatch(gpu_budget=8 * GIB, cpu_budget=None), peaks) == []


def test_a_leak_far_from_the_budget_waits_until_it_is_near() -> None:
    """A slow leak says nothing while the budget is more than the horizon away."""
    watch = CreepWatch(gpu_budget=40 * GIB, cpu_budget=None)
    peaks = [GIB + step * 100 * MIB for step in range(1, 400)]
    forecasts = _feed(watch, peaks)
    assert len(forecasts) == 1 and forecasts[0].step > 300


def test_the_data_segment_peak_is_held_against_the_cpu_cap() -> None:
    """On the CPU the peak is the data segment's: the forecast uses cpu_memory_limit, not the GPU budget."""
    watch = CreepWatch(gpu_budget=None, cpu_budget=GIB)
    beats = [_beat(step, 256 * MIB + step * 48 * MIB, ChildPeakSource.DATA_SEGMENT) for step in range(1, 16)]
    forecasts = [f for beat in beats if (f := watch.observe(beat))]
    assert len(forecasts) == 1 and forecasts[0].budget_bytes == GIB


def _scripted_job(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (tmp_path / "data.jsonl").write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(20)))
    job = {
        "model": {"path": "model"},
        "data": {"path": "data.jsonl"},
        "train": {"micro_batch_size": 1, "effective_batch_size": 1, "max_steps": 20, "save_steps": 50},
        "resources": {"gpu": "cpu", "cpu_memory_limit": "1000MiB"},
        "supervise": {"hang_timeout": "20s", "backoff_initial": "0.05s", "backoff_max": "0.2s"},
        "output_dir": "run",
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    (tmp_path / "plan.json").write_text(json.dumps({"1": "leak", "default": "ok"}))
    return tmp_path / "job.yaml"


def test_a_leaking_child_checkpoints_early_and_its_oom_kill_costs_no_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scripted child that leaks on purpose (``leak``): memory_creep, early checkpoints, OOM kill, 0 lost."""
    job = _scripted_job(tmp_path)
    monkeypatch.setenv("SCRIPTED_CHILD_PLAN", str(tmp_path / "plan.json"))
    assert (
        run_job(str(job), plain=True, seams=scripted_seams(), console=io.StringIO(), install_signals=False)
        == 0
    )
    run = tmp_path / "run"
    creep = [e for e in read_events(run / "events.jsonl") if e["event"] == "memory_creep"]
    assert len(creep) == 1 and creep[0]["early_checkpoint_requested"] is True
    assert abs(creep[0]["slope_bytes_per_step"] - 48 * MIB) < MIB
    assert creep[0]["predicted_oom_step"] == 16  # 256 MiB + 48 MiB x 16 passes the 1000 MiB cap
    child = [
        json.loads(line) for line in (run / "attempt-001" / "child-events.jsonl").read_text().splitlines()
    ]
    early = [e["step"] for e in child if e["event"] == "checkpoint_saved" and e["early"]]
    assert early and early[-1] == 15 and early[0] > creep[0]["step"]
    records, _ = read_attempts(run / "attempts.jsonl")
    first = records[0]
    assert first.failure is not None and first.failure.kind == "host_oom"
    assert first.steps_completed == 15 and first.next_resume_from == 15 and first.lost_steps == 0
    assert records[-1].outcome == "succeeded" and records[-1].resumed_from == 15


def _child_events(attempt_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (attempt_dir / "child-events.jsonl").read_text().splitlines()]


def _import_baseline() -> int:
    return import_baseline()  # measured with the torch installed here (tests/_machine.py)


@pytest.mark.slow
def test_the_real_trainer_with_a_test_leak_checkpoints_before_its_oom(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real trainer, tiny model, the TEST_LEAK_PER_STEP test hook: creep, early checkpoints, 0 lost steps."""
    monkeypatch.setenv("QLORA_SUPERVISE_TEST_LEAK_PER_STEP", str(48 * MIB))
    job = yaml.safe_load((tiny_dir / "job.yaml").read_text())
    job["model"]["path"] = str(tiny_dir / "model")
    job["data"]["path"] = str(tiny_dir / "data.jsonl")
    job["train"].update(micro_batch_size=1, effective_batch_size=1, max_seq_len=128, max_steps=18,
                        save_steps=100, logging_steps=1, optimizer="adamw_torch")  # fmt: skip
    job["resources"] = {"gpu": "cpu", "cpu_memory_limit": f"{_import_baseline() + 900 * MIB}B"}
    job["supervise"] = {
        "hang_timeout": "5m",
        "backoff_initial": "0.1s",
        "backoff_max": "1s",
        "max_attempts": 3,
    }
    job["output_dir"] = str(tmp_path / "run")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    seams = Seams(tick_s=0.05, sample_every_s=1.0)
    run_job(str(path), plain=True, seams=seams, console=io.StringIO(), install_signals=False)
    run = tmp_path / "run"
    creep = [e for e in read_events(run / "events.jsonl") if e["event"] == "memory_creep"]
    assert creep and creep[0]["attempt"] == 1 and creep[0]["early_checkpoint_requested"] is True
    child = [
        json.loads(line) for line in (run / "attempt-001" / "child-events.jsonl").read_text().splitlines()
    ]
    assert any(e["event"] == "early_checkpoint_requested" for e in child)
    early = [e["step"] for e in child if e["event"] == "checkpoint_saved" and e.get("early")]
    records, _ = read_attempts(run / "attempts.jsonl")
    first = records[0]
    assert first.failure is not None and first.failure.kind.is_oom, first.failure
    # The leak's OOM comes in a forward: the step before it is checkpointed already (early), so the
    # emergency save finds it complete and the restart resumes there.
    assert early and early[-1] == first.steps_completed and early[0] > creep[0]["step"]
    assert first.next_resume_from == first.steps_completed and first.lost_steps == 0
    assert os.environ["QLORA_SUPERVISE_TEST_LEAK_PER_STEP"]  # the hook was on for the whole run
