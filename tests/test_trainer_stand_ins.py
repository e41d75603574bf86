"""axolotl and LLaMA-Factory as the supervisor starts them, with stand-ins for the tools.

The tools themselves are not installed in this venv (axolotl runs for real in a venv of its
own, tests/test_trainer_tools_real.py; LLaMA-Factory cannot here, docs/trainers.md, "What was checked"): a
stand-in module of the same name (``axolotl.cli.train``, ``llamafactory.launcher``) reads the
attempt's YAML the way the tool is started on it and runs out of memory while the micro-batch is
above 2, in the tool's own spelling of the key. What is real: the per-attempt config the
supervisor writes, the argv, the stderr classification (the shim finds no Trainer here and says
so), the ladder and the journal.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import pytest
import yaml

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.record.journal import read_attempts

_TOOL = """
import os, sys, yaml
config = yaml.safe_load(open(sys.argv[-1]))
if config["{key}"] > 2:
    sys.stderr.write("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
                     "total capacity of 23.55 GiB of which 1.20 GiB is free.\\n")
    sys.exit(1)
os.makedirs(config["output_dir"], exist_ok=True)
open(os.path.join(config["output_dir"], "adapter_config.json"), "w").write("{{}}")
"""

CASES: dict[str, dict[str, Any]] = {
    "axolotl": {
        "module": "axolotl/cli/train.py",
        "key": "micro_batch_size",
        "file": "axolotl.yaml",
        "config": {"base_model": "m", "adapter": "qlora", "load_in_4bit": True, "lora_r": 8,
                   "lora_alpha": 16,
                   "datasets": [{"path": "/d", "type": "alpaca"}], "micro_batch_size": 8,
                   "gradient_accumulation_steps": 2, "gradient_checkpointing": True, "sequence_len": 1024,
                   "output_dir": "./out", "wandb_project": "kept as written"},
    },
    "llamafactory": {
        "module": "llamafactory/launcher.py",
        "key": "per_device_train_batch_size",
        "file": "llamafactory.yaml",
        "config": {"model_name_or_path": "m", "stage": "sft", "do_train": True, "finetuning_type": "lora",
                   "quantization_bit": 4, "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2,
                   "cutoff_len": 1024, "output_dir": "saves/x", "template": "kept as written"},
    },
}  # fmt: skip


@pytest.mark.parametrize("kind", sorted(CASES))
def test_the_tool_gets_its_own_config_with_the_batch_halved_and_the_effective_batch_kept(
    kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two stderr OOMs halve the micro-batch in the tool's own key, accumulation doubling; then it fits."""
    case = CASES[kind]
    tools = tmp_path / "tools"
    module = tools / case["module"]
    module.parent.mkdir(parents=True)
    for parent in [module.parent, *module.parent.parents]:
        if parent == tools:
            break
        (parent / "__init__.py").touch()
    module.write_text(_TOOL.format(key=case["key"]))
    monkeypatch.setenv("PYTHONPATH", str(tools))
    (tmp_path / "m").mkdir()  # the config's model, beside it: a local model directory
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "tool.yaml").write_text(yaml.safe_dump(case["config"]))
    user_file = (tmp_path / "tool.yaml").read_text()
    job = {"trainer": {"kind": kind, "config": "tool.yaml"}, "resources": {"gpu": "cpu"},
           "supervise": {"backoff_initial": "0.1s", "backoff_max": "1s",
                         "ladders": {"oom_forward": ["halve_micro_batch"]}},
           "output_dir": "./run"}  # fmt: skip
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert run_job(str(tmp_path / "job.yaml"), plain=True, console=io.StringIO(), install_signals=False) == 0
    run = tmp_path / "run"
    records, _ = read_attempts(run / "attempts.jsonl")
    assert [r.outcome for r in records] == ["failed", "failed", "succeeded"]
    assert [(r.knobs.micro_batch_size, r.knobs.grad_accum) for r in records] == [(8, 2), (4, 4), (2, 8)]
    assert all(r.knobs.effective_batch == 16 for r in records)
    last = yaml.safe_load((run / "attempt-003" / case["file"]).read_text())
    assert last[case["key"]] == 2 and last["gradient_accumulation_steps"] == 8
    assert last["output_dir"] == str(run / "trainer-output") and "resume_from_checkpoint" not in last
    kept = {
        k: v
        for k, v in case["config"].items()
        if k not in (case["key"], "gradient_accumulation_steps", "output_dir")
    }
    assert {k: last[k] for k in kept} == kept  # every other key exactly as the user wrote it
    diff = (run / "attempt-003" / "trainer-config.diff").read_text()
    assert f"{case['key']}: 8 -> 2" in diff and "gradient_accumulation_steps: 2 -> 8" in diff
    assert (tmp_path / "tool.yaml").read_text() == user_file
