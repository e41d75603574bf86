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
import os
import signal
import subprocess
import sys
import time
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


# -- item 10: the console is a best-effort output ----------------------------------------------

_SCRIPTED = Path(__file__).with_name("run_scripted.py")


@pytest.mark.parametrize("piped", ["stdout", "stdout and stderr"])
def test_ctrl_c_under_tee_exits_130_and_journals_the_stop(tmp_path: Path, piped: str) -> None:
    """``run job.yaml | tee log`` and Ctrl-C (SIGINT to the whole process group, so tee dies
    first): exit 130 (not 141), the stop journaled, the state stopped."""
    job = loop_job(tmp_path, {"default": "slow"}, train={"max_steps": 40})
    redirect = "2>&1" if piped == "stdout and stderr" else "2>/dev/null"
    command = (
        f"{sys.executable} {_SCRIPTED} --cli run {job} --plain {redirect} | tee {tmp_path / 'log'}; "
        f"echo ${{PIPESTATUS[0]}} > {tmp_path / 'status'}"
    )
    shell = subprocess.Popen(
        ["bash", "-c", command],
        cwd=tmp_path,
        start_new_session=True,  # its own process group: the terminal's Ctrl-C goes to all of it
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    child_events = tmp_path / "run" / "attempt-001" / "child-events.jsonl"
    deadline = time.monotonic() + 120
    while not (child_events.is_file() and '"heartbeat"' in child_events.read_text()):
        assert time.monotonic() < deadline and shell.poll() is None, "the child never trained a step"
        time.sleep(0.2)
    os.killpg(shell.pid, signal.SIGINT)
    shell.wait(timeout=120)
    assert (tmp_path / "status").read_text().strip() == "130"
    run = tmp_path / "run"
    records, _ = read_attempts(run / "attempts.jsonl")
    assert [r.outcome for r in records] == ["stopped"] and records[0].next_resume_from is not None
    assert json.loads((run / "state.json").read_text())["run_state"] == "stopped"
    # The console's loss is logged once when a log line met it (stderr in the pipe); stdout's
    # summary comes after the last event, so only its exit status shows it there.
    lost = [e for e in _events(run, "output_failed") if e["output"] == "console"]
    assert len(lost) == (1 if piped == "stdout and stderr" else 0), lost
    assert all("Broken pipe" in e["problem"] for e in lost)
