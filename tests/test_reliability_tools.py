"""Issue 29's tool items: a tool's refusal is a config error, an extended run keeps its schedule,
host OOM kills after progress, the console as a best-effort output, the tool's config as the job.

Real processes throughout: the scripted child for the loop's rules (seconds), small scripts for
the stderr rules, and the real trainer (ours, ``trl sft``) on the tiny model where only it shows
the behaviour (marked slow).
"""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts

sys.path.insert(0, str(Path(__file__).parent))
from _child import capped_job
from run_scripted import scripted_seams
from test_loop import _job as loop_job


def _run(job: Path) -> int:
    return run_job(str(job), plain=True, console=io.StringIO(), install_signals=False)


def _run_scripted(job: Path) -> int:
    return run_job(str(job), plain=True, seams=scripted_seams(), console=io.StringIO(), install_signals=False)


def _events(run: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(run / "events.jsonl") if e["event"] == name]


# -- item 8: an extended run continues its schedule as a run of the new length would ----------


def _cosine(step: int, total: int, base: float) -> float:
    """transformers' cosine schedule without warmup at ``step`` of ``total``."""
    return base * 0.5 * (1.0 + math.cos(math.pi * step / total))


@pytest.mark.slow
def test_an_extended_run_trains_its_first_new_step_on_the_new_schedule_not_at_lr_0(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """max_steps 2 -> 4 on a finished cosine run: step 3, its first new step, trains at the 4-step
    schedule's rate at step 2 (half the peak), not at the 2-step schedule's end (0)."""
    job = capped_job(tiny_dir, tmp_path, max_steps=2, save_steps=2, lr_scheduler="cosine", warmup_ratio=0.0)
    raw = yaml.safe_load(job.read_text())
    raw["resources"].pop("cpu_memory_limit")  # no OOM wanted here
    raw["train"].update(micro_batch_size=2, effective_batch_size=4, max_seq_len=64)
    job.write_text(yaml.safe_dump(raw))
    base = float(raw["train"]["learning_rate"])
    assert _run(job) == 0
    raw["train"]["max_steps"] = 4
    job.write_text(yaml.safe_dump(raw))
    assert _run(job) == 0
    run = tmp_path / "run"
    records, _ = read_attempts(run / "attempts.jsonl")
    assert [(r.outcome, r.resumed_from, r.steps_completed) for r in records] == [
        ("succeeded", 0, 2),
        ("succeeded", 2, 4),
    ]
    lines = (run / "attempt-002" / "child-events.jsonl").read_text().splitlines()
    (resumed,) = [e for e in map(json.loads, lines) if e.get("event") == "resumed"]
    assert resumed["from_step"] == 2
    assert resumed["learning_rate"] == pytest.approx(_cosine(2, 4, base), rel=1e-6)
    # The trainer's own log names the rate each step trained at: step k at the schedule's k - 1.
    state = json.loads((run / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
    logged = {e["step"]: e["learning_rate"] for e in state["log_history"] if "learning_rate" in e}
    assert logged[3] == pytest.approx(_cosine(2, 4, base), rel=1e-6)
    assert logged[4] == pytest.approx(_cosine(3, 4, base), rel=1e-6)


# -- item 7: a host OOM kill after progress is not "in a row" ---------------------------------


def test_two_host_oom_kills_with_five_good_steps_between_them_keep_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed by the kernel at step 4, then at step 9 after 5 good steps past the first kill: both
    retried unchanged (no rung, the rank kept), and the run finishes; a kill at the same step
    again is the config's own peak and walks the ladder's first throughput rung."""
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    monkeypatch.setenv("QLORA_SUPERVISE_CGROUP_MEMORY_EVENTS", str(events))
    monkeypatch.setenv("SCRIPTED_CHILD_OOM_EVENTS", str(events))
    apart = tmp_path / "apart"
    apart.mkdir()
    assert _run_scripted(loop_job(apart, {"1": "sigkill@4", "2": "sigkill@9"}, train={"save_steps": 2})) == 0
    records, _ = read_attempts(apart / "run" / "attempts.jsonl")
    assert [(r.outcome, r.steps_completed) for r in records] == [
        ("failed", 3),
        ("failed", 8),
        ("succeeded", 10),
    ]
    assert all(r.failure is not None and r.failure.kind == "host_oom" for r in records[:2])
    assert [r.decision.rung if r.decision else None for r in records[:2]] == ["retry_unchanged"] * 2
    assert records[0].knobs == records[1].knobs == records[2].knobs
    same_step = tmp_path / "same"
    same_step.mkdir()
    events.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    assert (
        _run_scripted(loop_job(same_step, {"1": "sigkill@4", "2": "sigkill@4"}, train={"save_steps": 2})) == 0
    )
    records, _ = read_attempts(same_step / "run" / "attempts.jsonl")
    assert [r.decision.rung if r.decision else None for r in records] == [
        "retry_unchanged",
        "gradient_checkpointing",
        None,
    ]
    assert records[2].knobs.lora_r == records[0].knobs.lora_r
