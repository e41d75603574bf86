"""The loop's pre-flight of issue 19: nothing fits stops before a child, attempt 1 carries the speed trial."""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml
from test_loop_fake_clock import LLAMA2_7B, FakeClock, _job, _run, _seams

from qlora_supervise.supervisor.exit_codes import SupervisorExitCode
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.trainer_child.contract.spec import AttemptSpec


def _llama_job(tmp_path: Path, cap: str, **train: object) -> Path:
    path = _job(tmp_path)
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA2_7B))
    job = yaml.safe_load(path.read_text())
    job["train"].update(micro_batch_size=4, effective_batch_size=16, max_seq_len=2048, **train)
    job["resources"]["gpu_memory_limit"] = cap
    path.write_text(yaml.safe_dump(job))
    return path


def test_nothing_fits_exits_before_any_child_in_seconds(tmp_path: Path) -> None:
    """A 7B on a 2 GiB cap with no fallback: exit 6, no attempt, and one event naming the smallest peak,
    the budget and what would help."""
    spawned: list[object] = []
    seams = _seams(FakeClock(), {})
    spawn = seams.spawn
    seams.spawn = lambda *args: spawned.append(args) or spawn(*args)  # type: ignore[func-returns-value]
    started = time.monotonic()
    assert _run(_llama_job(tmp_path, "2GiB"), seams) == int(SupervisorExitCode.NOTHING_FITS)
    assert time.monotonic() - started < 10 and not spawned
    assert not list((tmp_path / "run").glob("attempt-*"))
    [event] = [e for e in read_events(tmp_path / "run" / "events.jsonl") if e["event"] == "nothing_fits"]
    why = event["why"]
    assert "2.00 GiB" in why and "model.fallbacks" in why and "no child was started" in why


def test_attempt_1_carries_the_speed_trial_unless_turned_off(tmp_path: Path) -> None:
    """Attempt 1's spec lists the trial's candidates, its own config first; speed_trial: false empties it."""
    on = tmp_path / "on"
    on.mkdir()
    assert _run(_llama_job(on, "24GiB"), _seams(FakeClock(), {})) == 0
    spec = AttemptSpec.from_json((on / "run" / "attempt-001" / "spec.json").read_text())
    assert len(spec.speed_trial) >= 2
    first = spec.speed_trial[0]
    assert (first.micro_batch_size, first.grad_accum, first.gradient_checkpointing) == (
        spec.knobs.micro_batch_size,
        spec.knobs.grad_accum,
        spec.knobs.gradient_checkpointing,
    )
    # The trial drops a candidate measured above what the pre-flight planned within: 24 GiB less 8 %.
    assert spec.speed_trial_limit_bytes == int(24 * 2**30 / 1.08)
    off = tmp_path / "off"
    off.mkdir()
    job = _llama_job(off, "24GiB")
    raw = yaml.safe_load(job.read_text())
    raw["supervise"]["speed_trial"] = False
    job.write_text(yaml.safe_dump(raw))
    assert _run(job, _seams(FakeClock(), {})) == 0
    spec = AttemptSpec.from_json((off / "run" / "attempt-001" / "spec.json").read_text())
    assert spec.speed_trial == () and spec.speed_trial_limit_bytes is None
