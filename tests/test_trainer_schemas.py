"""The axolotl and LLaMA-Factory tables against each tool's own schema, read from its wheel.

The supervisor never imports either tool; these tests do, in a subprocess, from the wheels in
``.tool-wheels/`` when they are there, else fetched from the package index into the test's
temporary folder (``pip download --no-deps``: two wheels, 2 MB, about a second); skipped with the
command to run when neither works (no index). axolotl's pydantic schema
(``AxolotlInputConfig``) imports and validates with this venv's pydantic: an attempt config is
validated by it. LLaMA-Factory's argument dataclasses import omegaconf and pin transformers <= 5.6,
which this venv does not have, so their field names and defaults are read from the wheel's source
(``ast``, no import), and the inherited ``Seq2SeqTrainingArguments`` fields from this venv's
transformers.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from qlora_supervise.supervisor.trainers.mapping import attempt_config, knobs_from
from qlora_supervise.supervisor.trainers.tool import Table
from qlora_supervise.supervisor.trainers.tools.axolotl import TABLE as AXOLOTL
from qlora_supervise.supervisor.trainers.tools.llamafactory import TABLE as LLAMAFACTORY

ROOT = Path(__file__).resolve().parents[1]
WHEELS = Path(os.environ.get("QLORA_SUPERVISE_TOOL_WHEELS", ROOT / ".tool-wheels"))
AXOLOTL_WHEEL = "axolotl-0.19.0-py3-none-any.whl"
LLAMAFACTORY_WHEEL = "llamafactory-0.9.5-py3-none-any.whl"
DOWNLOAD = f"pip download --no-deps axolotl==0.19.0 llamafactory==0.9.5 -d {WHEELS}"


def _wheel(name: str, tmp_path: Path) -> Path:
    """The tool's wheel: from ``.tool-wheels/``, else downloaded (no dependencies) for this test."""
    if (WHEELS / name).is_file():
        return WHEELS / name
    project, version = name.split("-")[:2]
    fetched = tmp_path / "fetched"
    argv = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{project}=={version}"]
    with contextlib.suppress(subprocess.TimeoutExpired):
        subprocess.run([*argv, "-d", str(fetched)], capture_output=True, timeout=120, check=False)
    if not (fetched / name).is_file():
        pytest.skip(f"{WHEELS / name} is not there and the package index cannot be reached: `{DOWNLOAD}`")
    return fetched / name


def _unpacked(name: str, tmp_path: Path) -> Path:
    wheel = _wheel(name, tmp_path)
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(tmp_path / "wheel")
    return tmp_path / "wheel"


def _keys_named(table: Table) -> set[str]:
    """Every top-level key the table reads, writes or judges."""
    keys = {row.key.split(".")[0] for row in table.rows}
    keys |= {table.output_key, table.resume_key, *table.required, *(c.key for c in table.contradictions)}
    return keys


AXOLOTL_USER: dict[str, Any] = {
    "base_model": "/models/tiny",
    "datasets": [{"path": "/data/train.jsonl", "type": "completion"}],
    "adapter": "qlora",
    "load_in_4bit": True,
    "lora_r": 16,
    "lora_alpha": 32,
    "micro_batch_size": 4,
    "gradient_accumulation_steps": 4,
    "sequence_len": 2048,
    "learning_rate": 2.0e-4,
    "num_epochs": 1,
    "output_dir": "./out",
}

_AXOLOTL_CHECK = """
import json, sys
sys.path.insert(0, sys.argv[1])
from axolotl.utils.schemas.config import AxolotlInputConfig
fields = AxolotlInputConfig.model_fields
plain = (int, float, str, bool, type(None))
defaults = {k: f.default for k, f in fields.items() if isinstance(f.default, plain)}
config = AxolotlInputConfig.model_validate(json.loads(sys.argv[2]))
print(json.dumps({"fields": sorted(fields), "defaults": defaults, "parsed": config.model_dump(mode="json")}))
"""


@pytest.mark.slow
def test_axolotl_validates_an_attempt_config_and_knows_every_key(tmp_path: Path) -> None:
    """axolotl's own schema accepts the attempt config, reads each knob from it, has each key and default."""
    wheel = _unpacked(AXOLOTL_WHEEL, tmp_path)
    job = knobs_from(AXOLOTL, AXOLOTL_USER)
    knobs = dataclasses.replace(
        job,
        micro_batch_size=2,
        grad_accum=8,
        gradient_checkpointing=True,
        optimizer="paged_adamw_8bit",
        max_seq_len=1024,
        lora_r=8,
        lora_alpha=16,
        quant_type="fp4",
        double_quant=False,
        eval_batch_size=1,
    )
    config = attempt_config(
        AXOLOTL, AXOLOTL_USER, job, knobs, "/run/trainer-output", "/run/checkpoints/checkpoint-4"
    )
    done = subprocess.run(
        [sys.executable, "-c", _AXOLOTL_CHECK, str(wheel), json.dumps(config)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert not _keys_named(AXOLOTL) - set(result["fields"]), "keys axolotl does not know"
    parsed, expected = result["parsed"], dataclasses.asdict(knobs)
    for row in AXOLOTL.rows:
        head, _, rest = row.key.partition(".")
        value = parsed[head][rest] if rest else parsed[head]
        assert row.read(value) == expected[row.knob], row.key
        if not rest and not callable(row.default) and row.knob != "model":
            assert result["defaults"][row.key] == row.default, f"axolotl's default of {row.key}"
    assert parsed["resume_from_checkpoint"] == "/run/checkpoints/checkpoint-4"
    assert parsed["output_dir"] == "/run/trainer-output"


def _dataclass_defaults(source: Path) -> dict[str, Any]:
    """``name -> default`` of every annotated field of the module's classes, read without importing it."""
    out: dict[str, Any] = {}
    for node in ast.walk(ast.parse(source.read_text(encoding="utf-8"))):
        if not isinstance(node, ast.ClassDef):
            continue
        for stmt in node.body:
            if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                continue
            value = stmt.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", "") == "field":
                value = next((kw.value for kw in value.keywords if kw.arg == "default"), None)
            try:
                out[stmt.target.id] = ast.literal_eval(value) if value is not None else None
            except ValueError:
                out[stmt.target.id] = ast.unparse(value) if value is not None else None
    return out


def _transformers_defaults() -> dict[str, Any]:
    code = (
        "import dataclasses, json; from transformers import Seq2SeqTrainingArguments as T; "
        "print(json.dumps({f.name: f.default for f in dataclasses.fields(T) "
        "if isinstance(f.default, (int, float, str, bool, type(None)))}))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300
    )
    defaults: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return defaults


@pytest.mark.slow  # imports transformers in a subprocess
def test_llamafactory_has_every_key_with_the_tables_default(tmp_path: Path) -> None:
    """Each key of the LLaMA-Factory table is one of its argument fields, with the default the table gives."""
    hparams = _unpacked(LLAMAFACTORY_WHEEL, tmp_path) / "llamafactory" / "hparams"
    fields: dict[str, Any] = {}
    for name in ("model_args.py", "data_args.py", "finetuning_args.py", "training_args.py"):
        fields.update(_dataclass_defaults(hparams / name))
    inherited = _transformers_defaults()  # BaseTrainingArguments = transformers' Seq2SeqTrainingArguments
    known = {**inherited, **fields}
    assert not _keys_named(LLAMAFACTORY) - set(known) - {"deepspeed", "fsdp"}, (
        "keys LLaMA-Factory does not know"
    )
    for row in LLAMAFACTORY.rows:
        if row.knob == "model" or callable(row.default):
            continue
        assert known[row.key] == row.default, f"LLaMA-Factory's default of {row.key}"
    assert fields["lora_alpha"] is None  # the table's computed default: lora_rank * 2
    assert fields["finetuning_type"] == "lora" and fields["stage"] == "sft"


def test_llamafactory_reads_its_inverted_and_spelled_keys() -> None:
    """disable_gradient_checkpointing and quantization_bit: 4 become the knobs, and back."""
    user = {
        "model_name_or_path": "/m",
        "do_train": True,
        "disable_gradient_checkpointing": True,
        "quantization_bit": 4,
        "lora_rank": 16,
    }
    job = knobs_from(LLAMAFACTORY, user)
    assert job.gradient_checkpointing is False and job.load_in_4bit is True
    assert (job.lora_r, job.lora_alpha, job.max_seq_len) == (16, 32, 2048)
    knobs = dataclasses.replace(job, gradient_checkpointing=True, max_seq_len=1024)
    out = attempt_config(LLAMAFACTORY, user, job, knobs, "/o", None)
    assert out["disable_gradient_checkpointing"] is False and out["cutoff_len"] == 1024
    assert out["quantization_bit"] == 4


_HF_PARSE = """
import dataclasses, json, sys
from transformers import HfArgumentParser, TrainingArguments
args, = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(json.loads(sys.argv[1]))
print(json.dumps({k: v for k, v in vars(args).items() if isinstance(v, (int, float, str, bool, type(None)))}))
"""


@pytest.mark.slow
def test_hfargumentparser_reads_the_attempt_flags_as_the_table_says(tmp_path: Path) -> None:
    """transformers' own HfArgumentParser reads an hf-script attempt's argv as the knobs."""
    from qlora_supervise.supervisor.trainers.tools import hf_script
    from qlora_supervise.supervisor.trainers.trainer import ToolTrainer

    command = (
        "python",
        "train.py",
        "--output_dir",
        "out",
        "--per_device_train_batch_size",
        "8",
        "--bf16",
        "false",
    )
    user = {"output_dir": "out", "per_device_train_batch_size": 8, "bf16": False}
    trainer = ToolTrainer(hf_script.TOOL, user, None, command)
    job = knobs_from(hf_script.TABLE, user)
    knobs = dataclasses.replace(job, micro_batch_size=2, grad_accum=4, gradient_checkpointing=True)
    (tmp_path / "run").mkdir()
    argv = trainer.attempt_argv(tmp_path, tmp_path / "run", job, knobs, str(tmp_path / "checkpoint-3"))
    assert argv[:2] == ("python", "train.py")
    assert "--lora_r" not in argv and "--max_seq_length" not in argv  # not the script's flags: never added
    done = subprocess.run(
        [sys.executable, "-c", _HF_PARSE, json.dumps(list(argv[2:]))],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    assert (parsed["per_device_train_batch_size"], parsed["gradient_accumulation_steps"]) == (2, 4)
    assert parsed["resume_from_checkpoint"] == str(tmp_path / "checkpoint-3")
    assert parsed["output_dir"] == str(tmp_path / "run" / "trainer-output")
    assert json.loads((tmp_path / "command.json").read_text()) == list(argv)
