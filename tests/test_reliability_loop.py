"""The real supervisor over the scripted child (issue 11, items 2, 14, 15, 16): damaged
checkpoints quarantined, a hang killed after a short grace at its last stage, staging cleaned
on the way out, trust_remote_code warned at run start. Faults are injected by the scripted
child and named in its plan."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from typing import Any

import yaml

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.record.journal import read_attempts

sys.path.insert(0, str(Path(__file__).parent))
from run_scripted import scripted_seams
from test_loop import _events, _job, _run


def _edit(job: Path, **sections: dict[str, Any]) -> Path:
    raw = yaml.safe_load(job.read_text())
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    job.write_text(yaml.safe_dump(raw))
    return job


def test_a_checkpoint_damaged_after_its_marker_is_quarantined_and_the_older_one_resumed(
    tmp_path: Path,
) -> None:
    """Item 2: injected fault corrupt_newest: checkpoint-6 is truncated after sealing; resume skips it,
    moves it to checkpoints-quarantine/, logs checkpoint_quarantined, and resumes from checkpoint-4."""
    job = _edit(_job(tmp_path, {"1": "corrupt_newest@7", "default": "ok"}), train={"save_steps": 2})
    assert _run(job) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[0].steps_completed == 6
    assert records[1].resumed_from == 4 and records[1].outcome == "succeeded"
    moved = _events(tmp_path, "checkpoint_quarantined")
    assert [e["checkpoint"] for e in moved] == ["checkpoint-6"]
    assert "adapter.bin" in moved[0]["why"]
    quarantined = tmp_path / "run" / "checkpoints-quarantine" / "checkpoint-6"
    assert "differ from the completion marker" in (quarantined / "quarantine_reason.txt").read_text()


def test_a_hung_child_gets_the_short_hang_grace_and_its_last_stage_is_recorded(tmp_path: Path) -> None:
    """Item 15: a child stuck in backward that ignores SIGTERM is killed after hang_grace (not the
    10 s stop grace), and the hang is recorded in backward after step 2."""
    job = _job(tmp_path, {"1": "hang_hard@3", "default": "ok"}, hang_grace="0.5s")
    assert _run(job) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    failure = records[0].failure
    assert failure is not None and failure.kind == "hang" and failure.stage == "backward"
    assert "after step 2" in failure.evidence
    detected = _events(tmp_path, "hang_detected")[0]
    exited = next(e for e in _events(tmp_path, "child_exited") if e["attempt"] == 1)
    assert detected["grace_s"] == 0.5
    assert exited["time"] - detected["time"] < 5, "the hung child waited out the full stop grace"


def test_a_run_that_gives_up_leaves_no_staging_directory(tmp_path: Path) -> None:
    """Item 16: injected fault sigkill_in_save: killed saves' .tmp-checkpoint-* are gone after giving up."""
    job = _job(tmp_path, {"default": "sigkill_in_save@3"}, max_attempts=2)
    assert _run(job) == 3
    leftovers = [p.name for p in (tmp_path / "run" / "checkpoints").iterdir() if p.name.startswith(".tmp-")]
    assert leftovers == []
    assert [r.outcome for r in read_attempts(tmp_path / "run" / "attempts.jsonl")[0]] == ["failed", "failed"]


def test_trust_remote_code_is_warned_on_the_console_and_in_events_at_run_start(tmp_path: Path) -> None:
    """Item 14: a job with trust_remote_code says so at run start, on the console and in events.jsonl."""
    job = _edit(_job(tmp_path, {"default": "ok"}), model={"trust_remote_code": True})
    console = io.StringIO()
    assert run_job(str(job), plain=True, seams=scripted_seams(), console=console, install_signals=False) == 0
    warned = _events(tmp_path, "trust_remote_code")
    assert len(warned) == 1 and warned[0]["level"] == "warning"
    assert "Python code from the model directory" in warned[0]["why"]
    assert "trust_remote_code" in console.getvalue()
