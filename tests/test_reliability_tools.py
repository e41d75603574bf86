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


def _run(job: Path) -> int:
    return run_job(str(job), plain=True, console=io.StringIO(), install_signals=False)


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
