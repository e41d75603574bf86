"""A ``kind: script`` job's last rungs: its fallback models (``trainer.fallbacks``), swapped in at
``from_pretrained`` with the tokenizer of the same name, and the bf16 head kept out of the upcast of
its ``prepare_model_for_kbit_training``. The shim's hooks run on stand-in modules that hold the real
functions, so transformers and peft themselves stay unpatched for the other tests."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import yaml

from qlora_supervise.policies.rungs import RungContext, rung_by_name
from qlora_supervise.supervisor.jobfile.problems import JobError
from qlora_supervise.supervisor.trainers.job import load_job
from qlora_supervise.supervisor.trainers.tools import TOOLS
from qlora_supervise.supervisor.trainers.trainer import ToolTrainer, read_diff, tool_job_copy
from qlora_supervise.trainer_child.contract.events import ScriptKnobs
from qlora_supervise.trainer_child.contract.script_knobs import KnobSetting, ScriptChanges
from qlora_supervise.trainer_child.contract.spec import Knobs
from qlora_supervise.trainer_child.shim import script

# torch and transformers are imported by the tests that run, not at collection.


def _model_dir(path: Path) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def _job(tmp_path: Path, kind: str = "script", **trainer: Any) -> Path:
    (tmp_path / "train.py").write_text("print('hi')\n")
    section = {"kind": kind, "command": [sys.executable, "train.py"], **trainer}
    job = {"trainer": section, "resources": {"gpu": "cpu"}, "output_dir": "run"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


def _problems(path: Path) -> list[str]:
    with pytest.raises(JobError) as caught:
        load_job(path)
    return [p.render() for p in caught.value.problems]


def test_a_script_names_its_fallbacks_and_validate_checks_each(tmp_path: Path) -> None:
    """``trainer.fallbacks`` become the job's fallbacks; a missing one, or one of another kind, is refused."""
    small = _model_dir(tmp_path / "small")
    job = load_job(_job(tmp_path, fallbacks=["small"]))
    assert job.fallback_models == (str(small),)
    # install-systemd's copy lives elsewhere: the fallback is written absolute there.
    copy = yaml.safe_load(tool_job_copy(job, yaml.safe_load(job.raw_text)))
    assert copy["trainer"]["fallbacks"] == [str(small)]
    [missing] = _problems(_job(tmp_path, fallbacks=["small", "tiny"]))
    assert "trainer.fallbacks.1: no such directory" in missing
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump({"model_name_or_path": str(small)}))
    other = _problems(_job(tmp_path, kind="trl-sft", command=None, config="sft.yaml", fallbacks=["small"]))
    assert any("trainer.fallbacks: not used with trainer.kind trl-sft" in p for p in other)


def test_only_the_script_takes_the_bf16_head_and_smaller_model_rungs(tmp_path: Path) -> None:
    """The script's ladders keep bf16_head and smaller_model (its shim applies them); trl-sft's do not."""
    _model_dir(tmp_path / "small")
    job = load_job(_job(tmp_path, fallbacks=["small"]))
    assert {"bf16_head", "smaller_model"} <= job.trainer.rungs()
    assert not {"bf16_head", "smaller_model"} & job.trainer.cannot_take()
    sft = ToolTrainer(TOOLS["trl-sft"], {"use_peft": True})
    assert {"bf16_head", "smaller_model"} <= sft.cannot_take()
    assert all("bf16_head" not in ladder for ladder in sft.ladders({}).values())
    assert any("bf16_head" in ladder for ladder in job.trainer.ladders({}).values())


def test_the_smaller_model_rung_names_the_fallback_and_the_script_model_it_replaces(tmp_path: Path) -> None:
    """From what attempt 1 loaded, the rung moves to the first fallback; the attempt's changes name the
    script's model, for its tokenizer."""
    big, small = _model_dir(tmp_path / "big"), _model_dir(tmp_path / "small")
    job = load_job(_job(tmp_path, fallbacks=["small"]))
    run, first, second = tmp_path / "run", tmp_path / "run" / "attempt-001", tmp_path / "run" / "attempt-002"
    first.mkdir(parents=True)
    second.mkdir()
    loaded = KnobSetting("model", script.NAME, str(big), str(big), "AutoModelForCausalLM.from_pretrained")
    (first / "child-events.jsonl").write_text(ScriptKnobs(settings=(loaded,), complete=True).to_line())
    built = job.trainer.built_knobs(job.knobs, run)
    smaller = rung_by_name("smaller_model", RungContext(job.fallback_models)).apply(built)
    assert smaller is not None and smaller.model == str(small)
    job.trainer.attempt_argv(second, run, job.knobs, smaller, None)
    changes = ScriptChanges.read(second)
    assert changes is not None and changes.knobs == ("model",) and changes.replaced_model == str(big)
    assert read_diff(second) == [f"model: {big} -> {small}"]


def _saved_model_and_tokenizer(path: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from qlora_supervise.trainer_child.recipe.tiny import build_tokenizer, tiny_rows

    tokenizer = build_tokenizer(tiny_rows(4))
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


def test_the_shim_loads_the_fallback_model_and_its_tokenizer_in_place_of_the_scripts(tmp_path: Path) -> None:
    """``from_pretrained`` of the script's model and tokenizer both read the attempt's fallback; another
    tokenizer name is left as the script wrote it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    big, small = tmp_path / "big", tmp_path / "small"
    _saved_model_and_tokenizer(big)
    _saved_model_and_tokenizer(small)
    ledger = script.Ledger(
        ScriptChanges(("model",), str(tmp_path / "out"), str(big)), Knobs(model=str(small))
    )
    # Stand-ins that define from_pretrained as the real bases do, so the patch lands on them alone.
    models = type(
        "Models",
        (AutoModelForCausalLM,),
        {"from_pretrained": _BaseAutoModelClass.__dict__["from_pretrained"]},
    )
    tokenizers = type(
        "Tokenizers", (AutoTokenizer,), {"from_pretrained": AutoTokenizer.__dict__["from_pretrained"]}
    )
    hooks = script.patches(ledger)
    hooks["transformers.models.auto.auto_factory"](types.SimpleNamespace(_BaseAutoModelClass=models))
    hooks["transformers.models.auto.tokenization_auto"](types.SimpleNamespace(AutoTokenizer=tokenizers))
    assert tokenizers.from_pretrained(str(big)).name_or_path == str(small)
    assert models.from_pretrained(str(big)).name_or_path == str(small)
    assert tokenizers.from_pretrained(str(small)).name_or_path == str(small)  # not the script's model: kept
    lines = [s.line() for s in ledger.settings if s.asked != s.got]
    assert lines == [
        f"pretrained_model_name_or_path: {big} -> {small} (applied at AutoTokenizer.from_pretrained)",
        f"pretrained_model_name_or_path: {big} -> {small} (applied at Models.from_pretrained)",
    ]


def _bf16_llama() -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(torch.bfloat16)


def _prepared(changes: tuple[str, ...]) -> tuple[Any, script.Ledger]:
    import peft

    ledger = script.Ledger(ScriptChanges(changes, "/out"), Knobs(model="m", bf16_head=True))
    real = peft.prepare_model_for_kbit_training
    other = types.SimpleNamespace(prepare_model_for_kbit_training=real)
    peft_like = types.SimpleNamespace(
        prepare_model_for_kbit_training=real,
        utils=types.SimpleNamespace(prepare_model_for_kbit_training=real, other=other),
    )
    script.patches(ledger)["peft"](peft_like)
    model = peft_like.prepare_model_for_kbit_training(_bf16_llama(), use_gradient_checkpointing=False)
    return model, ledger


def test_the_shim_keeps_the_scripts_head_in_bf16_through_its_prepare_when_the_attempt_says() -> None:
    """With bf16_head the tied embeddings and head stay bf16 (norms fp32) and a forward runs; without it
    the script's prepare upcasts them as written."""
    import torch

    model, ledger = _prepared(("bf16_head",))
    assert model.get_output_embeddings().weight.dtype == torch.bfloat16
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert {p.dtype for name, p in model.named_parameters() if "norm" in name} == {torch.float32}
    assert model(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 128)
    assert "bf16_head: False -> True (applied at prepare_model_for_kbit_training)" in [
        s.line() for s in ledger.settings
    ]
    as_written, _ = _prepared(())
    assert as_written.get_output_embeddings().weight.dtype == torch.float32


def test_a_script_without_prepare_reports_the_bf16_head_as_not_applied() -> None:
    """A script that never calls prepare_model_for_kbit_training has no upcast to skip: the knob is
    named not applied at train(), so the ladder moves on."""
    ledger = script.Ledger(ScriptChanges(("bf16_head",), "/out"), Knobs(model="m", bf16_head=True))
    ledger.check(types.SimpleNamespace(args=types.SimpleNamespace()))
    [setting] = ledger.settings
    assert setting.knob == "bf16_head" and setting.why_not is not None
    assert "builds no prepare_model_for_kbit_training" in setting.why_not
