"""Job files with a ``trainer:`` section: loaded from the tool's config, refused with every problem named."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path
from typing import Any

import pytest
import yaml

from qlora_supervise.supervisor.commands.validate import validate_command
from qlora_supervise.supervisor.jobfile.problems import JobError
from qlora_supervise.supervisor.loop.settings import policy_settings
from qlora_supervise.supervisor.trainers.job import load_job
from qlora_supervise.trainer_child.contract.codes import FailureKind

SFT = {
    "model_name_or_path": "model",  # beside sft.yaml: _job makes it
    "dataset_name": "/data/set",
    "use_peft": True,
    "per_device_train_batch_size": 4,
    "gradient_accumulation_steps": 4,
    "max_steps": 100,
    "save_steps": 10,
}


def _job(tmp_path: Path, job: dict[str, Any], sft: dict[str, Any] | None = None) -> Path:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(SFT if sft is None else sft))
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


def _problems(path: Path) -> list[str]:
    with pytest.raises(JobError) as caught:
        load_job(path)
    return [p.render() for p in caught.value.problems]


def test_a_trl_job_takes_its_knobs_from_the_tools_config(tmp_path: Path) -> None:
    """The job's knobs, steps and model come from sft.yaml; resources and supervise from the job."""
    job = load_job(
        _job(
            tmp_path,
            {
                "trainer": {"kind": "trl-sft", "config": "sft.yaml"},
                "resources": {"gpu": "cpu", "cpu_memory_limit": "2GiB"},
            },
        )
    )
    assert job.trainer.kind == "trl-sft"
    assert job.trainer.config_path == tmp_path / "sft.yaml"
    assert (job.knobs.micro_batch_size, job.knobs.grad_accum, job.knobs.effective_batch) == (4, 4, 16)
    assert (
        job.knobs.model == str(tmp_path / "model")
        and job.train.max_steps == 100
        and job.train.save_steps == 10
    )
    assert job.resources.cpu_memory_limit == 2 << 30 and job.output_dir == tmp_path / "run"


def test_a_foreign_ladder_holds_only_the_tools_rungs(tmp_path: Path) -> None:
    """The forward ladder loses activation offload and a smaller model; the speed trial stays on
    (the shim runs it in the tool's process: tests/test_trainer_trial_real.py)."""
    job = load_job(_job(tmp_path, {"trainer": {"kind": "trl-sft", "config": "sft.yaml"}}))
    settings = policy_settings(job)
    assert settings.overrides[FailureKind.OOM_FORWARD] == (
        "gradient_checkpointing",
        "halve_micro_batch",
        "shorten_seq_len",
    )
    assert "bf16_head" not in settings.overrides[FailureKind.OOM_LOAD]
    assert settings.speed_trial is True


def test_our_sections_and_a_bad_config_are_all_named_at_once(tmp_path: Path) -> None:
    """model/train sections, auto_find_batch_size and a missing use_peft: one problem each."""
    sft = {**SFT, "auto_find_batch_size": True}
    del sft["use_peft"]
    path = _job(
        tmp_path,
        {
            "trainer": {"kind": "trl-sft", "config": "sft.yaml"},
            "model": {"path": "x"},
            "train": {"max_steps": 3},
            "resources": {"nproc_per_node": 2},
        },
        sft,
    )
    lines = _problems(path)
    assert len(lines) == 5, lines
    assert any(line.startswith("  model: not used with trainer.kind trl-sft") for line in lines)
    assert any(line.startswith("  train: not used with trainer.kind trl-sft") for line in lines)
    assert any("auto_find_batch_size" in line and "delete auto_find_batch_size" in line for line in lines)
    assert any("use_peft: required key is missing" in line for line in lines)
    assert any(line.startswith("  resources.nproc_per_node") for line in lines)


def test_validate_exits_2_naming_the_missing_config(tmp_path: Path) -> None:
    """A config file that is not there is one problem; validate prints it and exits 2."""
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"trainer": {"kind": "trl-sft", "config": "nope.yaml"}}))
    out = io.StringIO()
    with redirect_stdout(out):
        assert validate_command(str(path)) == 2
    assert "trainer.config: no such file" in out.getvalue()


@pytest.mark.parametrize(
    ("trainer", "words"),
    [
        ({"kind": "trl-sft"}, "trainer.config: required for kind trl-sft"),
        ({"kind": "hf-script"}, "trainer.command: required for kind hf-script"),
        ({"kind": "trl-sft", "config": "sft.yaml", "command": ["python", "x.py"]}, "only for kind hf-script"),
        ({"kind": "hf-script", "command": "python train.py"}, "trainer.command"),
        ({"kind": "deepspeed"}, "trainer.kind: not an allowed value"),
    ],
)
def test_a_trainer_section_that_cannot_work_is_refused(
    tmp_path: Path, trainer: dict[str, Any], words: str
) -> None:
    """Each malformed trainer section names the field and the fix (argv lists, never a shell string)."""
    lines = _problems(_job(tmp_path, {"trainer": trainer}))
    assert any(words in line for line in lines), lines


def test_kind_own_is_our_trainer_as_before(tmp_path: Path) -> None:
    """``trainer: {kind: own}`` is the default trainer: the usual sections, no foreign trainer."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "data.jsonl").write_text('{"text": "a"}\n')
    job = load_job(
        _job(
            tmp_path, {"trainer": {"kind": "own"}, "model": {"path": "model"}, "data": {"path": "data.jsonl"}}
        )
    )
    assert job.trainer.kind == "own"


def test_validate_summarises_the_tool_and_its_keys(tmp_path: Path) -> None:
    """validate names the tool, its config, the keys the ladder may set and the rungs."""
    out = io.StringIO()
    with redirect_stdout(out):
        assert (
            validate_command(str(_job(tmp_path, {"trainer": {"kind": "trl-sft", "config": "sft.yaml"}}))) == 0
        )
    text = out.getvalue()
    assert "trainer: trl-sft, config" in text and "never modified" in text
    assert "per_device_train_batch_size, gradient_accumulation_steps" in text


def test_install_systemd_copies_a_foreign_job_with_absolute_paths(tmp_path: Path) -> None:
    """The installed copy names the tool's config, its folder and the run dir absolutely."""
    from qlora_supervise.supervisor.commands.install_systemd import job_copy

    job = load_job(_job(tmp_path, {"trainer": {"kind": "trl-sft", "config": "sft.yaml"}}))
    copy = yaml.safe_load(job_copy(job))
    assert copy["trainer"] == {
        "kind": "trl-sft",
        "config": str(tmp_path / "sft.yaml"),
        "workdir": str(tmp_path),
    }
    assert copy["output_dir"] == str(tmp_path / "run")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "job.yaml").write_text(yaml.safe_dump(copy))
    again = load_job(tmp_path / "elsewhere" / "job.yaml")
    assert again.trainer.cwd(tmp_path / "elsewhere", tmp_path / "run", ("python", "train.py")) == tmp_path
    assert again.trainer.cwd(tmp_path / "elsewhere", tmp_path / "run", ()) == tmp_path / "run"
    assert again.trainer.config == job.trainer.config if job.trainer else False


@pytest.mark.parametrize(
    ("model", "words"),
    [
        ("meta-llama/Llama-2-7b-hf", "model_name_or_path: a hub id, but the tool runs offline"),
        ("nowhere", "model_name_or_path: no such directory"),
        ("sft.yaml", "model_name_or_path: not a directory"),
        ("empty", "model_name_or_path: no config.json in the directory"),
    ],
)
def test_validate_refuses_a_tool_model_that_is_no_local_model_directory(
    tmp_path: Path, model: str, words: str
) -> None:
    """The tool's model key must name a local directory with config.json (the child runs offline);
    a hub id is told to be downloaded and the key pointed at the directory."""
    (tmp_path / "empty").mkdir()
    path = _job(
        tmp_path, {"trainer": {"kind": "trl-sft", "config": "sft.yaml"}}, {**SFT, "model_name_or_path": model}
    )
    out = io.StringIO()
    with redirect_stdout(out):
        assert validate_command(str(path)) == 2
    text = out.getvalue()
    assert f"trainer.config (sft.yaml): {words}" in text, text
    if "/" in model:
        assert f"hf download {model}" in text and "point model_name_or_path at that directory" in text


def test_an_hf_script_model_flag_is_checked_where_the_command_has_it(tmp_path: Path) -> None:
    """--model_name_or_path of a hub id is refused; a command without that flag is not checked."""
    command = ["python", "train.py", "--output_dir", "out", "--model_name_or_path", "org/name"]
    lines = _problems(_job(tmp_path, {"trainer": {"kind": "hf-script", "command": command}}))
    assert any("trainer.command: model_name_or_path: a hub id" in line for line in lines), lines
    job = load_job(_job(tmp_path, {"trainer": {"kind": "hf-script", "command": command[:4]}}))
    assert job.trainer.kind == "hf-script" and job.knobs.model == ""
