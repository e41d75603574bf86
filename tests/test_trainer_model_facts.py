"""What a tool's config says about memory beyond the knobs: its weights, its attention, its peaks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.policies.memory_model import Observation, calibrate, estimate_peak
from qlora_supervise.supervisor.commands.plan import make_plan
from qlora_supervise.supervisor.jobfile.problems import JobError
from qlora_supervise.supervisor.loop.settings import policy_settings
from qlora_supervise.supervisor.record.peak_store import read_observations, read_speeds, record_attempt
from qlora_supervise.supervisor.trainers.job import load_job
from qlora_supervise.trainer_child.contract.spec import Knobs

#: The Llama-2-7B shape (its config.json's sizes): the plan reads nothing else.
LLAMA_7B = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 32, "vocab_size": 32000, "max_position_embeddings": 4096,
            "tie_word_embeddings": False, "torch_dtype": "float16"}  # fmt: skip
AXOLOTL_QLORA = {"base_model": "model", "adapter": "qlora", "load_in_4bit": True, "lora_r": 8,
                 "lora_alpha": 16, "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
                 "sequence_len": 2048,
                 "micro_batch_size": 2, "gradient_accumulation_steps": 4, "gradient_checkpointing": True,
                 "optimizer": "paged_adamw_8bit", "datasets": [{"path": "d.jsonl", "type": "alpaca"}],
                 "output_dir": "./out"}  # fmt: skip

#: A 4-bit config of each kind, the smallest each tool's table takes.
QLORA_BASE: dict[str, dict[str, Any]] = {
    "axolotl": AXOLOTL_QLORA,
    "llamafactory": {"model_name_or_path": "model", "do_train": True, "quantization_bit": 4},
    "trl-sft": {"model_name_or_path": "model", "use_peft": True, "load_in_4bit": True},
}


def _job(tmp_path: Path, kind: str, config: dict[str, Any]) -> Path:
    (tmp_path / "model").mkdir(parents=True, exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA_7B))
    (tmp_path / "tool.yaml").write_text(yaml.safe_dump(config))
    job = {"trainer": {"kind": kind, "config": "tool.yaml"}, "resources": {"gpu": 0}, "output_dir": "./run"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


@pytest.mark.parametrize(
    ("kind", "keys", "words"),
    [
        ("axolotl", {"adapter": "lora", "load_in_4bit": False, "load_in_8bit": True}, "load_in_8bit: true"),
        ("axolotl", {"adapter": "lora", "load_in_4bit": False, "bf16": True}, "unquantized"),
        ("llamafactory", {"quantization_bit": 8}, "quantization_bit: 8"),
        ("llamafactory", {"quantization_method": "hqq"}, "quantization_method: hqq"),
        ("trl-sft", {"load_in_4bit": False, "load_in_8bit": True}, "load_in_8bit: true"),
    ],
)
def test_weights_the_model_does_not_count_start_as_written_not_nothing_fits(
    tmp_path: Path, kind: str, keys: dict[str, Any], words: str
) -> None:
    """A 7B LoRA in 8-bit or bf16 on a 24 GiB card: no prediction (not 'nothing fits' from fp32
    weights it does not have), the reason named, in plan and in run's settings alike."""
    base = {
        "axolotl": AXOLOTL_QLORA,
        "llamafactory": {"model_name_or_path": "model", "do_train": True, "finetuning_type": "lora",
                         "quantization_bit": 4, "cutoff_len": 2048, "per_device_train_batch_size": 2},
        "trl-sft": {"model_name_or_path": "model", "use_peft": True, "load_in_4bit": True,
                    "max_length": 2048},
    }[kind]  # fmt: skip
    path = _job(tmp_path, kind, {**base, **keys})
    plan = make_plan(str(path), "24GiB")
    assert plan["start"] is None and plan["peak_bytes"] is None
    assert plan["unsupported"]["reason"] == "not_modelled" and words in plan["unsupported"]["detail"]
    assert "starts as written" in plan["unsupported"]["detail"]
    settings = policy_settings(load_job(path))
    assert settings.shape is None and settings.unmodelled is not None and words in settings.unmodelled


def test_a_4bit_config_is_planned_and_names_no_reason(tmp_path: Path) -> None:
    path = _job(tmp_path, "axolotl", AXOLOTL_QLORA)
    plan = make_plan(str(path), "24GiB")
    assert plan["unsupported"] is None and plan["start"] is not None and plan["fits_as_written"]
    assert policy_settings(load_job(path)).unmodelled is None


@pytest.mark.parametrize(
    ("kind", "keys", "attention"),
    [
        ("axolotl", {"attn_implementation": "eager"}, "eager"),
        ("axolotl", {"eager_attention": True}, "eager"),
        ("axolotl", {"attn_implementation": "flash_attention_2"}, "sdpa"),
        ("llamafactory", {"flash_attn": "disabled"}, "eager"),
        ("llamafactory", {"flash_attn": "auto"}, None),
        ("trl-sft", {"attn_implementation": "eager"}, "eager"),
        ("trl-sft", {}, None),
    ],
)
def test_the_tools_attention_choice_is_read_in_its_own_key(
    tmp_path: Path, kind: str, keys: dict[str, Any], attention: str | None
) -> None:
    base = QLORA_BASE[kind]
    job = load_job(_job(tmp_path, kind, {**base, **keys}))
    assert job.trainer.attention() == attention


def test_eager_attention_in_the_tools_config_raises_the_plans_peak(tmp_path: Path) -> None:
    """The seq x seq scores of eager attention at seq 2048 are in the plan when axolotl asks for it."""
    sdpa = make_plan(str(_job(tmp_path / "sdpa", "axolotl", AXOLOTL_QLORA)), "24GiB")
    eager_config = {**AXOLOTL_QLORA, "attn_implementation": "eager"}
    eager = make_plan(str(_job(tmp_path / "eager", "axolotl", eager_config)), "24GiB")
    assert eager["shape"]["attn_implementation"] == "eager" and sdpa["shape"]["attn_implementation"] == "sdpa"
    assert eager["peak_bytes"] > sdpa["peak_bytes"] * 1.2


def test_the_peak_store_keeps_each_trainers_peaks_apart(tmp_path: Path) -> None:
    """axolotl's peaks calibrate axolotl only; a line without a trainer (the store before this
    field, which held foreign tools' peaks unlabelled too) calibrates nothing."""
    shape = ModelShape.from_config(LLAMA_7B)
    assert isinstance(shape, ModelShape)
    store = tmp_path / "peaks.jsonl"
    knobs = Knobs(model="m")
    assert record_attempt(store, shape, knobs, 6 << 30, 2000.0, "axolotl")
    assert record_attempt(store, shape, knobs, 8 << 30, 1500.0)
    older = {"shape": shape.sizes(), "knobs": json.loads(store.read_text().splitlines()[1])["knobs"],
             "peak_bytes": 5 << 30, "tokens_per_s": 3000.0, "time": 1.0}  # fmt: skip
    with store.open("a") as out:
        out.write(json.dumps(older) + "\n")
    assert [o.peak_bytes for o in read_observations(store, shape, "axolotl")] == [6 << 30]
    assert [o.peak_bytes for o in read_observations(store, shape)] == [8 << 30]
    assert [s.tokens_per_s for s in read_speeds(store, shape)] == [1500.0]
    assert read_observations(store, shape, "llamafactory") == []


def test_a_string_of_names_peft_would_match_to_nothing_is_refused_with_the_list(tmp_path: Path) -> None:
    """trl hands peft the string as a pattern of the full module name: 'q_proj,v_proj' adapts no
    layer (peft stops with 'Target modules not found'); validate names it and the list to write."""
    config = {"model_name_or_path": "model", "use_peft": True, "load_in_4bit": True,
              "lora_target_modules": "q_proj,v_proj"}  # fmt: skip
    with pytest.raises(JobError) as caught:
        load_job(_job(tmp_path, "trl-sft", config))
    shown = "\n".join(p.render() for p in caught.value.problems)
    assert "lora_target_modules" in shown and "regular expression" in shown
    assert "write a list: [q_proj, v_proj]" in shown
    one = {**config, "lora_target_modules": ["q_proj"]}  # trl hands peft a one-name list as that string
    with pytest.raises(JobError) as caught:
        load_job(_job(tmp_path, "trl-sft", one))
    assert "write the pattern: '.*\\.q_proj'" in caught.value.problems[0].render()
    pattern = {**config, "lora_target_modules": r".*\.(q_proj|v_proj)"}
    assert load_job(_job(tmp_path, "trl-sft", pattern)).train.target_modules == ("q_proj", "v_proj")


@pytest.mark.parametrize(
    ("kind", "keys", "epochs"),
    [("axolotl", {"num_epochs": 4}, 4.0), ("axolotl", {}, 1.0),
     ("llamafactory", {"num_train_epochs": 2.0}, 2.0), ("trl-sft", {}, 3.0)],
)  # fmt: skip
def test_the_epochs_are_read_in_each_tools_key_with_its_default(
    tmp_path: Path, kind: str, keys: dict[str, Any], epochs: float
) -> None:
    """axolotl's num_epochs (its default 1), num_train_epochs elsewhere (TrainingArguments' 3)."""
    base = QLORA_BASE[kind]
    assert load_job(_job(tmp_path, kind, {**base, **keys})).train.epochs == epochs


@pytest.mark.parametrize(
    ("kind", "keys", "kept"),
    [("trl-sft", {"dtype": "bfloat16"}, True), ("trl-sft", {"dtype": "auto"}, True),
     ("trl-sft", {}, False), ("axolotl", {"bf16": True}, False)],
)  # fmt: skip
def test_trl_in_16_bits_keeps_its_head_in_them(
    tmp_path: Path, kind: str, keys: dict[str, Any], kept: bool
) -> None:
    """trl never runs k-bit prepare: with dtype bfloat16 its head stays bf16 (counted as bf16_head);
    with trl's default float32 it is fp32, as our recipe counts it."""
    base = QLORA_BASE[kind]
    assert load_job(_job(tmp_path, kind, {**base, **keys})).knobs.bf16_head is kept


#: trl 1.16 sft in its own process on the H200 (2026-12-03; bench/results/foreign-trainers-trl-
#: trial-h200-2026-12-03): the speed trial's measured peaks, Llama-2-7B shape, seq 1024,
#: checkpointing, r 8 on q/k/v/o, paged AdamW 8-bit, dtype bfloat16: micro-batch -> bytes.
TRL_H200_PEAKS = {1: 4564537856, 2: 5065986560, 4: 6086316544, 8: 8205357568, 16: 12443439616}


def test_one_scale_explains_trls_peaks_once_its_head_is_counted_in_bf16() -> None:
    """Calibrated by the micro-batch 4 peak alone, the model predicts the others within 3 %; with
    the head counted in fp32 the same calibration misses micro-batch 16 by more than 10 %."""
    shape = ModelShape.from_config(LLAMA_7B)
    assert isinstance(shape, ModelShape)
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")

    def knobs(micro: int, bf16_head: bool) -> Knobs:
        return Knobs(model="m", micro_batch_size=micro, grad_accum=16 // micro, max_seq_len=1024,
                     gradient_checkpointing=True, optimizer="paged_adamw_8bit", lora_r=8, lora_alpha=16,
                     bf16_head=bf16_head)  # fmt: skip

    for bf16_head, worst in ((True, 0.03), (False, None)):
        seen = [Observation(knobs(4, bf16_head), TRL_H200_PEAKS[4])]
        scale = calibrate(shape, seen, targets)
        errors = {
            micro: estimate_peak(shape, knobs(micro, bf16_head), scale, targets) / peak - 1
            for micro, peak in TRL_H200_PEAKS.items()
        }
        if worst is not None:
            assert max(abs(e) for e in errors.values()) < worst, errors
        else:
            assert errors[16] < -0.10, errors


def _saved(tmp_path: Path, quant: dict[str, Any]) -> None:
    (tmp_path / "model").mkdir(parents=True, exist_ok=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps({**LLAMA_7B, "quantization_config": quant}))


def test_a_model_saved_in_4bit_is_planned_as_the_4bit_weights_it_loads_as(tmp_path: Path) -> None:
    """A ``*-bnb-4bit`` model with no 4-bit key in trl's config: transformers loads it in 4-bit as
    saved, so it is counted as 4-bit with the saved quant type, not called an unquantized LoRA."""
    config = {"model_name_or_path": "model", "use_peft": True, "max_length": 2048}
    path = _job(tmp_path, "trl-sft", config)
    _saved(tmp_path, {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "nf4",
                      "bnb_4bit_use_double_quant": True})  # fmt: skip
    job = load_job(path)
    assert (job.knobs.load_in_4bit, job.knobs.quant_type, job.knobs.double_quant) == (True, "nf4", True)
    plan = make_plan(str(path), "24GiB")
    assert plan["unsupported"] is None and plan["peak_bytes"] is not None
    quantized = make_plan(str(_job(tmp_path / "q", "trl-sft", {**config, "load_in_4bit": True})), "24GiB")
    assert abs(plan["peak_bytes"] - quantized["peak_bytes"]) < 0.1 * quantized["peak_bytes"]


@pytest.mark.parametrize(
    ("quant", "words"),
    [
        ({"quant_method": "gptq", "bits": 4}, "gptq, 4-bit"),
        ({"quant_method": "awq", "bits": 4}, "awq, 4-bit"),
        ({"quant_method": "bitsandbytes", "load_in_8bit": True}, "bitsandbytes 8-bit"),
        (
            {
                "quant_method": "bitsandbytes",
                "load_in_4bit": True,
                "llm_int8_skip_modules": ["mlp.down_proj"],
            },
            "bitsandbytes 4-bit with modules left unquantized",
        ),
    ],
)
def test_a_model_saved_in_another_quantization_is_named_and_not_predicted(
    tmp_path: Path, quant: dict[str, Any], words: str
) -> None:
    path = _job(tmp_path, "llamafactory", QLORA_BASE["llamafactory"])
    _saved(tmp_path, quant)
    plan = make_plan(str(path), "24GiB")
    assert plan["unsupported"]["reason"] == "not_modelled"
    assert f"saved already quantized ({words}" in plan["unsupported"]["detail"]


def test_trl_without_truncation_gets_no_prediction_and_the_reason(tmp_path: Path) -> None:
    """``max_length: null`` is trl's "do not truncate": no seq_len to count, so none is invented."""
    path = _job(tmp_path, "trl-sft", {**QLORA_BASE["trl-sft"], "max_length": None})
    detail = make_plan(str(path), "24GiB")["unsupported"]["detail"]
    assert "max_length: null" in detail and "set max_length to a number" in detail
    assert (
        make_plan(str(_job(tmp_path / "b", "trl-sft", QLORA_BASE["trl-sft"])), "24GiB")["unsupported"] is None
    )


def test_llamafactory_dataset_names_are_looked_up_where_it_will_look(tmp_path: Path) -> None:
    """LLaMA-Factory stops at load without ``dataset_dir/dataset_info.json`` or with a name not in
    it; validate names both, relative to the folder the tool runs in. ONLINE names the hub."""
    config = {**QLORA_BASE["llamafactory"], "dataset": "mine, other"}
    with pytest.raises(JobError, match=r"dataset_dir: LLaMA-Factory looks up its datasets \(mine, other\)"):
        load_job(_job(tmp_path, "llamafactory", config))
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "dataset_info.json").write_text(json.dumps({"mine": {"file_name": "m.json"}}))
    with pytest.raises(JobError, match=r"dataset: not defined in .*dataset_info.json \(got 'other'"):
        load_job(_job(tmp_path, "llamafactory", config))
    assert load_job(_job(tmp_path, "llamafactory", {**config, "dataset": "mine"})).trainer is not None
    tokenized = {**config, "tokenized_path": "tokenized"}  # LLaMA-Factory loads a saved one as is
    (tmp_path / "t" / "tokenized").mkdir(parents=True)
    assert load_job(_job(tmp_path / "t", "llamafactory", tokenized)).trainer is not None
    online = {**config, "dataset_dir": "ONLINE", "dataset": "org/set"}
    assert load_job(_job(tmp_path / "o", "llamafactory", online)).trainer is not None


def test_a_model_path_with_a_tilde_is_refused_with_the_full_path(tmp_path: Path) -> None:
    """``~/models/x`` in a tool's config is opened as written (no shell expands it): say so."""
    with pytest.raises(
        JobError, match=r"starts with ~, which the tool does not expand.*write the full path: /"
    ):
        load_job(_job(tmp_path, "trl-sft", {**QLORA_BASE["trl-sft"], "model_name_or_path": "~/models/x"}))


def test_llamafactory_names_its_method_only_where_it_quantizes(tmp_path: Path) -> None:
    """``quantization_method: hqq`` without ``quantization_bit`` loads the model unquantized."""
    config = {"model_name_or_path": "model", "do_train": True, "quantization_method": "hqq"}
    detail = make_plan(str(_job(tmp_path, "llamafactory", config)), "24GiB")["unsupported"]["detail"]
    assert "unquantized" in detail and "hqq" not in detail
