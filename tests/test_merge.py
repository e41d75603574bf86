"""The low-memory merge on the tiny model: plan, device, dtype, sharded safetensors, equal logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _child import child_env, events, make_spec, run_child

from qlora_supervise.supervisor.commands.cli import main
from qlora_supervise.trainer_child.merge.process import MergeSizes, plan_merge

CHECK = Path(__file__).with_name("merge_check.py")
GIB = 2**30


def _check(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, str(CHECK), *args], env=child_env(), capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_merged_model_loads_and_its_logits_equal_base_plus_adapter(tiny_dir: Path, tmp_path: Path) -> None:
    """The merge child writes safetensors shards in bf16 whose logits match base + adapter within bf16."""
    run_dir = tmp_path / "run"
    _check("adapter", str(tiny_dir / "model"), str(run_dir / "adapter"))
    spec = make_spec(tiny_dir, run_dir, train={"compute_dtype": "bf16"})
    assert run_child(spec, module="qlora_supervise.trainer_child.merge.process") == 0
    merged = run_dir / "merged"
    report = json.loads((merged / "merge.json").read_text())
    assert report["device"] == "cpu" and report["dtype"] == "bfloat16" and report["host_peak_bytes"] > 0
    assert report["shards"] and all(name.endswith(".safetensors") for name in report["shards"])
    assert next(e for e in events(spec) if e["event"] == "merge_plan")["device"] == "cpu"
    got = json.loads(_check("compare", str(tiny_dir / "model"), str(run_dir / "adapter"), str(merged)))
    assert got["dtypes"] == ["torch.bfloat16"] and not got["has_lora"]
    assert got["adapter_effect"] > 0.05  # the adapter changes the logits: equality below means something
    assert got["max_abs_diff"] <= 0.02 * got["logit_scale"] + 0.05  # bf16 carries ~3 significant digits


@pytest.mark.slow
def test_merge_command_merges_a_finished_run_and_status_shows_its_numbers(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`qlora-supervise merge RUN_DIR` uses the run's last spec; it prints the device and the peaks."""
    run_dir = tmp_path / "run"
    _check("adapter", str(tiny_dir / "model"), str(run_dir / "adapter"))
    spec = make_spec(tiny_dir, run_dir)
    (run_dir / "attempt-001").mkdir(parents=True)
    (run_dir / "attempt-001" / "spec.json").write_text(spec.to_json())
    # merge works on a run of ours only: the event log every run starts with marks it so.
    (run_dir / "events.jsonl").write_text('{"event": "run_started", "level": "info"}\n')
    assert main(["merge", str(run_dir), "--device", "auto"]) == 0
    out = capsys.readouterr().out
    assert f"merged: {run_dir / 'merged'}" in out and "host peak" in out
    assert (run_dir / "merged" / "config.json").is_file()


def test_merge_plan_picks_the_gpu_only_when_gpu_and_host_both_fit() -> None:
    """auto: the GPU when weights, adapter and one delta fit its free memory and the host holds the shards."""
    sizes = MergeSizes(weights=13 * GIB, adapter=GIB // 16, largest_layer=GIB // 8, largest_shard=5 * GIB)
    assert plan_merge(sizes, "auto", gpu_free=40 * GIB, host_available=32 * GIB).device == "cuda"
    small_card = plan_merge(sizes, "auto", gpu_free=12 * GIB, host_available=32 * GIB)
    assert small_card.device == "cpu" and "GPU memory" in small_card.why
    tight_host = plan_merge(sizes, "auto", gpu_free=40 * GIB, host_available=6 * GIB)
    assert tight_host.device == "cpu" and "host RAM" in tight_host.why
    assert plan_merge(sizes, "auto", gpu_free=None, host_available=32 * GIB).device == "cpu"
    assert plan_merge(sizes, "cpu", gpu_free=40 * GIB, host_available=32 * GIB).device == "cpu"
    cpu = plan_merge(sizes, "auto", gpu_free=12 * GIB, host_available=32 * GIB)
    assert (
        cpu.host_need_cpu_bytes > sizes.weights > cpu.host_need_gpu_bytes
    )  # the CPU merge holds the model in RAM
