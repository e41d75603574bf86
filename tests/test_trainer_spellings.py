"""The tools' own spellings of the LoRA targets and of 4-bit, read into our knobs."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from qlora_supervise.supervisor.trainers.mapping import attempt_config, config_diff, knobs_from
from qlora_supervise.supervisor.trainers.model_facts import lora_targets
from qlora_supervise.supervisor.trainers.tools import TOOLS
from qlora_supervise.supervisor.trainers.tools.axolotl import TABLE as AXOLOTL
from qlora_supervise.supervisor.trainers.tools.llamafactory import TABLE as LLAMAFACTORY
from qlora_supervise.supervisor.trainers.tools.trl_sft import TABLE as TRL_SFT

QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")


@pytest.mark.parametrize(
    ("kind", "config", "expected"),
    [
        ("llamafactory", {"lora_target": "all"}, "all-linear"),
        ("llamafactory", {"lora_target": "q_proj,k_proj, v_proj ,o_proj"}, QKVO),
        ("llamafactory", {"lora_target": "q_proj"}, ("q_proj",)),
        ("llamafactory", {}, "all-linear"),
        # trl and axolotl hand a string to peft, which fullmatches it as a pattern: this one adapts
        # nothing (validate names it), this one q and v.
        ("trl-sft", {"lora_target_modules": "q_proj,v_proj"}, "q_proj,v_proj"),
        ("trl-sft", {"lora_target_modules": r".*\.(q_proj|v_proj)"}, ("q_proj", "v_proj")),
        ("trl-sft", {}, ("q_proj", "v_proj")),  # peft's default for llama
        ("trl-sft", {"lora_target_modules": [r".*\.q_proj"]}, ("q_proj",)),  # trl: a one-name list
        (
            "trl-sft",
            {"lora_target_modules": r".*\.layers\.(1[0-5])\.self_attn\.v_proj"},
            ("v_proj",),
        ),
        ("trl-sft", {"lora_target_modules": "all-linear"}, "all-linear"),
        ("trl-sft", {"lora_target_modules": list(QKVO)}, QKVO),
        ("axolotl", {"lora_target_linear": True}, "all-linear"),
        ("axolotl", {"lora_target_linear": True, "lora_target_modules": ["q_proj"]}, "all-linear"),
        ("axolotl", {"lora_target_linear": False, "lora_target_modules": list(QKVO)}, QKVO),
        (
            "axolotl",
            {"lora_target_modules": r"model\.layers\.\d+\.mlp\..*"},
            ("gate_proj", "up_proj", "down_proj"),
        ),
    ],
)
def test_lora_targets_read_each_tools_spelling(
    kind: str, config: dict[str, Any], expected: tuple[str, ...] | str
) -> None:
    """`all`, LLaMA-Factory's comma-separated names, peft's patterns and defaults (a llama), and
    axolotl's lora_target_linear become our targets."""
    assert lora_targets(TOOLS[kind], config, "llama") == expected


def test_llamafactory_without_quantization_bit_is_not_4bit() -> None:
    """No quantization_bit reads as load_in_4bit False (a bool), 4 as True, 8 as False."""
    base = {"model_name_or_path": "/m", "do_train": True}
    assert knobs_from(LLAMAFACTORY, base).load_in_4bit is False
    assert knobs_from(LLAMAFACTORY, {**base, "quantization_bit": 4}).load_in_4bit is True
    assert knobs_from(LLAMAFACTORY, {**base, "quantization_bit": 8}).load_in_4bit is False
    assert knobs_from(AXOLOTL, {"base_model": "/m"}).load_in_4bit is False
    assert knobs_from(TRL_SFT, {"model_name_or_path": "/m"}).load_in_4bit is False


def test_transformers_5s_activation_checkpointing_is_read_first_and_written_with_its_alias() -> None:
    """activation_checkpointing wins over its deprecated alias gradient_checkpointing (as
    TrainingArguments resolves them); a change is written to both where the config has both."""
    config = {"model_name_or_path": "m", "use_peft": True, "activation_checkpointing": False,
              "gradient_checkpointing": True}  # fmt: skip
    knobs = knobs_from(TRL_SFT, config)
    assert knobs.gradient_checkpointing is False
    on = dataclasses.replace(knobs, gradient_checkpointing=True)
    written = attempt_config(TRL_SFT, config, knobs, on, "/out", None)
    assert written["activation_checkpointing"] is True and written["gradient_checkpointing"] is True
    alone = {"model_name_or_path": "m", "use_peft": True, "activation_checkpointing": False}
    written = attempt_config(TRL_SFT, alone, knobs_from(TRL_SFT, alone), on, "/out", None)
    assert written["activation_checkpointing"] is True and "gradient_checkpointing" not in written


def test_a_key_written_as_null_and_one_removed_are_no_difference() -> None:
    """resume_from_checkpoint: null in the user's file, removed for a fresh attempt: no diff line."""
    assert config_diff({"resume_from_checkpoint": None, "a": 1}, {"a": 2}) == ["a: 1 -> 2"]
    assert config_diff({"x": [1]}, {"x": None}) == ["x: [1] -> null"]
