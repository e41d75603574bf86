"""Resume lands on the right step and sample after a micro-batch/seq change, a SIGTERM or a SIGKILL."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
from _child import (
    events,
    log_tail,
    make_spec,
    next_spec,
    run_child,
    start_child,
    wait_for_event,
)
from _machine import scaled

from qlora_supervise.trainer_child.contract.checkpoints import complete_checkpoints
from qlora_supervise.trainer_child.contract.codes import ExitCode

pytestmark = pytest.mark.slow
TRACE = "QLORA_SUPERVISE_TEST_TRACE_BATCHES"


def rows_by_step(trace: Path) -> dict[int, list[str]]:
    """Row fingerprints of each optimizer step, order-free (micro-batch boundaries may move)."""
    steps: dict[int, list[str]] = {}
    for line in trace.read_text().splitlines():
        record = json.loads(line)
        steps.setdefault(record["step"], []).extend(record["rows"])
    return {step: sorted(rows) for step, rows in steps.items()}


def test_sigterm_checkpoints_and_resume_with_new_micro_batch_and_seq_len_sees_the_next_samples(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """SIGTERM exits 73 after a checkpoint; micro 2 x 4 at a shorter seq_len resumes there on unseen rows."""
    reference = make_spec(
        tiny_dir,
        tmp_path / "reference",
        knobs={"micro_batch_size": 4, "grad_accum": 2},
        train={"max_steps": 6, "save_steps": 100},
    )
    assert run_child(reference, **{TRACE: str(tmp_path / "reference.jsonl")}) == ExitCode.OK, log_tail(
        reference
    )
    expected = rows_by_step(tmp_path / "reference.jsonl")

    run = tmp_path / "run"
    first = make_spec(
        tiny_dir,
        run,
        knobs={"micro_batch_size": 4, "grad_accum": 2},
        train={"max_steps": 6, "save_steps": 100},
    )
    child = start_child(first, **{TRACE: str(tmp_path / "first.jsonl")})
    wait_for_event(first, lambda e: e["event"] == "heartbeat" and e["step"] >= 1, child)
    child.send_signal(signal.SIGTERM)
    assert child.wait(scaled(120)) == ExitCode.STOPPED, log_tail(first)  # generous, scaled
    seen = events(first)
    assert any(e["event"] == "stopping" for e in seen)
    stopped_at = next(e for e in seen if e["event"] == "checkpoint_saved")["step"]
    assert 1 <= stopped_at < 6
    assert [step for step, _ in complete_checkpoints(first.checkpoints_dir)] == [stopped_at]

    second = next_spec(
        first,
        knobs={"micro_batch_size": 2, "grad_accum": 4, "max_seq_len": 96},
        resume_from=str(Path(first.checkpoints_dir) / f"checkpoint-{stopped_at}"),
    )
    assert run_child(second, **{TRACE: str(tmp_path / "second.jsonl")}) == ExitCode.OK, log_tail(second)
    resumed = rows_by_step(tmp_path / "second.jsonl")
    assert sorted(resumed) == list(range(stopped_at + 1, 7))
    for step in resumed:
        assert resumed[step] == expected[step], f"step {step} trained on other rows"
    assert next(e for e in events(second) if e["event"] == "finished")["step"] == 6


def test_sigkill_during_checkpoint_write_leaves_no_usable_partial_checkpoint(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """A kill mid-write leaves only a temp dir, ignored by resume; a resume (optimizer reset) finishes."""
    spec = make_spec(tiny_dir, tmp_path, train={"max_steps": 6, "save_steps": 2})
    # Injected fault: sleep inside the write of checkpoint-4 so the kill lands mid-write.
    child = start_child(spec, QLORA_SUPERVISE_TEST_PAUSE_IN_SAVE="120@4")
    wait_for_event(spec, lambda e: e.get("test_pause_in_save") and e["step"] == 4, child)
    child.kill()
    child.wait(30)
    root = Path(spec.checkpoints_dir)
    assert [step for step, _ in complete_checkpoints(root)] == [2]
    temps = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert temps and (temps[0] / "checkpoint-4" / "adapter_model.safetensors").exists()

    resumed = next_spec(spec, resume_from="auto", reset_optimizer=True)
    assert run_child(resumed) == ExitCode.OK, log_tail(resumed)
    event = next(e for e in events(resumed) if e["event"] == "resumed")
    assert event["from_step"] == 2 and event["reset_optimizer"] is True
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())
    assert [step for step, _ in complete_checkpoints(root)] == [2, 4, 6]
