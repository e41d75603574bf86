"""explain (table, JSON, plot) and status --json on the recorded H200 bench run directory."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from qlora_supervise.supervisor.commands.cli import main
from qlora_supervise.supervisor.commands.explain import explain_command, explanation
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract.codes import Stage
from qlora_supervise.trainer_child.contract.events import ChildPeakSource, Heartbeat, MemoryNumbers

RESULTS = Path(__file__).resolve().parents[1] / "bench/results/gpu-h200-2026-11-29"
BENCH_RUN = RESULTS / "after-fix/cap-8GiB"
MODEL_CONFIG = RESULTS / "model-config.json"


def test_explain_table_tells_the_bench_retry_story_with_predictions() -> None:
    """One row per attempt: kind, stage, the request, the rung, the steps, measured and predicted peak."""
    out = io.StringIO()
    assert explain_command(str(BENCH_RUN), model_config=str(MODEL_CONFIG), out=out) == 0
    rows = out.getvalue().splitlines()
    assert rows[0].split()[:3] == ["#", "outcome", "stage"]
    assert rows[1].split()[:3] == ["1", "oom_forward", "forward"] and "gradient_checkpointing" in rows[1]
    assert "oom_fragmentation" in rows[2] and "reserved-free 951.75 MiB" in rows[2]
    assert "1->6" in rows[5] and "(6.02 GiB)" in rows[5]  # predicted for 1 x 16 (5.96 measured)
    assert rows[-1] == "budget: 8.00 GiB"


def test_explain_json_has_every_attempt_with_numbers_and_wall_time() -> None:
    """--json: the schema, the budget, and per attempt the failure, rung, steps and timings."""
    out = io.StringIO()
    assert explain_command(str(BENCH_RUN), as_json=True, model_config=str(MODEL_CONFIG), out=out) == 0
    story = json.loads(out.getvalue())
    assert story["schema"] == "qlora-supervise.explain/1" and story["budget_bytes"] == 8 * 2**30
    kinds = [a["kind"] for a in story["attempts"]]
    assert kinds == ["oom_forward", "oom_fragmentation", "oom_forward", "oom_backward", None]
    last = story["attempts"][-1]
    assert last["steps"] == [1, 6] and last["outcome"] == "succeeded" and last["wall_s"] > 60
    assert all(a["predicted_peak_bytes"] for a in story["attempts"])


def test_explain_names_the_policys_reason_for_each_config() -> None:
    """Each attempt after the first ran its config for the decision after the one before, as said."""
    story = explanation(RunDir(BENCH_RUN), MODEL_CONFIG)
    whys = [a["why"] for a in story["attempts"]]
    records, _ = read_attempts(RunDir(BENCH_RUN).attempts)
    assert whys[1:] == [[r.decision.why] for r in records[:-1] if r.decision is not None]
    assert "recompute activations" in whys[1][0]
    out = io.StringIO()
    explain_command(str(BENCH_RUN), model_config=str(MODEL_CONFIG), out=out)
    assert f"why #2 ran its config: {whys[1][0]}" in out.getvalue().splitlines()


def test_status_json_on_several_run_directories(capsys: pytest.CaptureFixture[str]) -> None:
    """status --json reads runs whose supervisor is gone, several at once, with each failure's log."""
    assert main(["status", str(BENCH_RUN), str(RESULTS / "cap-16GiB"), "--json"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["schema"] == "qlora-supervise.status/1"
    first, second = status["runs"]
    assert first["state"] == "succeeded" and len(first["attempts"]) == 5
    assert first["attempts"][0]["child_log"].endswith("attempt-001/child.log")
    assert first["attempts"][0]["fix"] == "recompute activations in backward instead of keeping them"
    assert second["run_dir"].endswith("cap-16GiB")


def _with_heartbeats(tmp_path: Path) -> RunDir:
    """The bench run, copied, with heartbeats like the child writes (the bench kept none)."""
    root = tmp_path / "run"
    shutil.copytree(BENCH_RUN, root)
    rd = RunDir(root)
    records, _ = read_attempts(rd.attempts)
    for r in records:
        lines = []
        for i in range(8):
            t = r.started_at + (r.ended_at - r.started_at) * i / 8
            memory = MemoryNumbers(
                peak_bytes=int((4 + i * 0.4) * 2**30),
                peak_source=ChildPeakSource.CUDA_ALLOCATOR,
                allocated_bytes=int((4 + i * 0.4) * 2**30),
            )
            line = json.loads(Heartbeat(Stage.FORWARD, r.resumed_from, memory=memory).to_line())
            lines.append(json.dumps({**line, "time": t}) + "\n")
        rd.attempt_dir(r.attempt).mkdir(exist_ok=True)
        (rd.attempt_dir(r.attempt) / "child-events.jsonl").write_text("".join(lines))
    return rd


def test_explain_plot_writes_a_png_of_every_attempt(tmp_path: Path) -> None:
    """--plot draws a PNG; the series come from each attempt's heartbeats."""
    rd = _with_heartbeats(tmp_path)
    png = tmp_path / "memory.png"
    assert main(["explain", str(rd.root), "--plot", str(png), "--model-config", str(MODEL_CONFIG)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    assert [a["samples"] for a in explanation(rd)["attempts"]] == [8] * 5


def test_the_supervisor_never_imports_matplotlib() -> None:
    """run, status and explain without --plot leave matplotlib (and torch) unimported."""
    code = (
        "import sys; import qlora_supervise.supervisor.commands.run;"
        "import qlora_supervise.supervisor.commands.explain, qlora_supervise.supervisor.commands.status;"
        "print('matplotlib' in sys.modules, 'torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "False"]
