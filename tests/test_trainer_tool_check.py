"""A tool its interpreter lacks is refused before any attempt; a venv without the shim is warned of."""

from __future__ import annotations

import io
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest
import yaml

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.commands.validate import validate_command
from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode

AXOLOTL = {"base_model": "model", "adapter": "qlora", "load_in_4bit": True, "lora_r": 8, "lora_alpha": 16,
           "datasets": [{"path": "d.jsonl", "type": "alpaca"}], "output_dir": "./out"}  # fmt: skip


def _job(tmp_path: Path, trainer: dict[str, object]) -> Path:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "axolotl.yaml").write_text(yaml.safe_dump(AXOLOTL))
    job = {"trainer": trainer, "resources": {"gpu": "cpu"}, "output_dir": "./run"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


def test_a_tool_not_installed_for_its_python_is_refused_at_validate_and_run(tmp_path: Path) -> None:
    """This venv has no axolotl: validate names trainer.python and the fix; run exits BAD_JOB at
    once, with no attempt started (not three identical failures and a crash loop)."""
    path = _job(tmp_path, {"kind": "axolotl", "config": "axolotl.yaml"})
    out = io.StringIO()
    with redirect_stdout(out):
        assert validate_command(str(path)) == 2
    shown = out.getvalue()
    assert "trainer.python: axolotl is not installed for this interpreter" in shown
    assert f"{sys.executable} -m pip install axolotl" in shown
    with pytest.raises(SupervisorExit) as caught:
        run_job(str(path), plain=True, console=io.StringIO(), install_signals=False)
    assert caught.value.code is SupervisorExitCode.BAD_JOB and "axolotl is not installed" in str(caught.value)
    assert not (tmp_path / "run").exists()


def test_a_python_without_qlora_supervise_gets_a_warning_not_a_refusal(tmp_path: Path) -> None:
    """An hf-script run by a bare venv's python: it would train, but the shim cannot attach there."""
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True, timeout=120)
    python = str(bare / "bin" / "python")
    command = [python, "train.py", "--output_dir", "out", "--model_name_or_path", str(tmp_path / "model")]
    path = _job(tmp_path, {"kind": "hf-script", "command": command})
    out = io.StringIO()
    with redirect_stdout(out):
        assert validate_command(str(path)) == 0
    assert f"warning: trainer.python: qlora-supervise is not importable by {python}" in out.getvalue()
    assert "pip install --no-deps qlora-supervise" in out.getvalue()


def test_an_old_trl_key_name_trl_would_drop_is_a_warning_with_the_new_name(tmp_path: Path) -> None:
    """max_seq_length (trl < 0.20) is dropped by trl's parser without a word: validate says so."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    sft = {"model_name_or_path": "model", "use_peft": True, "max_seq_length": 2048, "torch_dtype": "bfloat16",
           "dtype": "bfloat16"}  # fmt: skip
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(sft))
    job = {
        "trainer": {"kind": "trl-sft", "config": "sft.yaml"},
        "resources": {"gpu": "cpu"},
        "output_dir": "./r",
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    out = io.StringIO()
    with redirect_stdout(out):
        assert validate_command(str(tmp_path / "job.yaml")) == 0
    shown = out.getvalue()
    assert "warning: sft.yaml: max_seq_length: trl-sft no longer reads max_seq_length" in shown
    assert "rename it to max_length" in shown and "seq_len 1024" in shown
    assert "rename it to dtype (both are set: delete torch_dtype)" in shown
