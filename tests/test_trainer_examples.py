"""The foreign-trainer examples: each job loads, and the hf-script example trains under the shim."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import pytest
import yaml
from _machine import MIB, above_baseline
from _trainer_configs import text_dataset

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.supervisor.trainers.job import load_job
from qlora_supervise.supervisor.trainers.tools import TOOLS

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "trainers"


@pytest.mark.parametrize("kind", list(TOOLS))
def test_each_kind_has_an_example_that_loads(kind: str, tmp_path: Path) -> None:
    """examples/trainers/<kind>/job.yaml is a valid job of that kind with an effective batch of 16,
    once its model path points at a local model directory (as the examples of our own trainer); a
    script's settings are in its code, so its job loads as it is, naming the script beside it."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    example = EXAMPLES / kind
    job = yaml.safe_load((example / "job.yaml").read_text())
    job["output_dir"] = str(tmp_path / "run")
    if kind == "script":
        job["trainer"]["command"][0] = sys.executable  # `python` need not be on the test's PATH
        (tmp_path / "job.yaml").write_text(
            yaml.safe_dump({**job, "trainer": {**job["trainer"], "workdir": str(example)}})
        )
        assert load_job(tmp_path / "job.yaml").trainer.kind == kind
        return
    if kind == "hf-script":
        command = job["trainer"]["command"]
        command[command.index("--model_name_or_path") + 1] = str(model)
        job["trainer"]["workdir"] = str(example)
    else:
        name = job["trainer"]["config"]
        config = yaml.safe_load((example / name).read_text())
        key = "base_model" if kind == "axolotl" else "model_name_or_path"
        assert config[key] == "/srv/models/llama-2-7b"
        config[key] = str(model)
        if kind == "llamafactory":  # its dataset names are looked up in dataset_dir
            assert config["dataset_dir"] == "/srv/data"
            (tmp_path / "data").mkdir()
            (tmp_path / "data" / "dataset_info.json").write_text(json.dumps({config["dataset"]: {}}))
            config["dataset_dir"] = str(tmp_path / "data")
        (tmp_path / name).write_text(yaml.safe_dump(config))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    loaded = load_job(tmp_path / "job.yaml")
    assert loaded.trainer.kind == kind
    assert loaded.knobs.effective_batch == 16 and loaded.knobs.model == str(model)


@pytest.mark.slow
def test_the_hf_script_example_is_supervised_through_a_plain_trainer(tiny_dir: Path, tmp_path: Path) -> None:
    """The example script's plain transformers Trainer OOMs in forward, is reported by the shim, and
    finishes with gradient checkpointing added to its flags."""
    data = text_dataset(tiny_dir, tmp_path) / "train.jsonl"
    job = yaml.safe_load((EXAMPLES / "hf-script" / "job.yaml").read_text())
    command = [sys.executable, str(EXAMPLES / "hf-script" / "train.py"),
               "--model_name_or_path", str(tiny_dir / "model"), "--dataset_path", str(data),
               "--output_dir", "out", "--per_device_train_batch_size", "16", "--max_seq_length", "256",
               "--max_steps", "3", "--save_steps", "2", "--logging_steps", "1", "--report_to", "none",
               "--use_cpu", "true"]  # fmt: skip
    job["trainer"]["command"] = command
    # The tiny model in fp32 at micro-batch 16, seq 256: ~0.8 GiB of data segment without
    # checkpointing, ~0.6 GiB with it; the cap between them.
    job["resources"] = {"gpu": "cpu", "cpu_memory_limit": f"{above_baseline(340 * MIB)}B"}
    job["supervise"] = {"backoff_initial": "0.1s", "backoff_max": "1s", "hang_timeout": "5m"}
    job["output_dir"] = str(tmp_path / "run")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert run_job(str(tmp_path / "job.yaml"), plain=True, console=io.StringIO(), install_signals=False) == 0
    run = tmp_path / "run"
    records, _ = read_attempts(run / "attempts.jsonl")
    assert [r.outcome for r in records] == ["failed", "succeeded"]
    first = records[0]
    assert first.failure is not None and first.failure.kind == "oom_forward"
    assert "error report" in first.failure.evidence  # the shim's, from inside the plain Trainer
    assert records[1].knobs.gradient_checkpointing and records[1].steps_completed == 3
    argv = json.loads((run / "attempt-002" / "command.json").read_text())
    assert argv[argv.index("--gradient_checkpointing") + 1] == "true"
    assert "--max_seq_length" in argv and argv[argv.index("--output_dir") + 1] == str(run / "trainer-output")
    assert (run / "adapter" / "adapter_model.safetensors").is_file()
    assert "shim_not_attached" not in [e["event"] for e in read_events(run / "events.jsonl")]
