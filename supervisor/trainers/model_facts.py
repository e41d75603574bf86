"""What a foreign tool's config says about the model's memory that the knobs do not: whether its
weights are ones the memory model counts, and which attention the tool asks transformers for.

The memory model counts our recipe's weights: 4-bit NF4 (QLoRA), or, unquantized, every weight
upcast to fp32 as our child's k-bit prepare leaves them. A tool that loads the base model in
8-bit (LLM.int8, ``load_in_8bit`` / ``quantization_bit: 8``) or unquantized in its own dtype (a
plain LoRA in bf16: no k-bit prepare, no upcast) is neither, and a guess would be off by a factor
of two or more either way: reading bf16 weights as fp32 calls a 7B LoRA that fits a 24 GiB card
one that fits nothing, and stops the run before it starts. So for those configs there is no
prediction: the attempt starts as written and the reactive ladder guards it, as for an
architecture the model does not cover. (An hf-script is counted only where its command has
``--load_in_4bit true``: what else a script loads is its own.) The model directory counts too: a
model saved in bitsandbytes 4-bit loads so whatever the tool's keys say, and is counted as such;
one saved in another quantization (GPTQ, AWQ, 8-bit, 4-bit with modules left in 16 bits) is not
counted, nor is trl's ``max_length: null`` (no truncation: no sequence length to count).

The attention implementation changes the model's activations (eager keeps a seq x seq score
tensor per head), so a tool's explicit choice replaces transformers' default for the model type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.supervisor.facts.trainer import Trainer
from qlora_supervise.supervisor.jobfile.bounds import json_loads
from qlora_supervise.supervisor.trainers.mapping import knobs_from, lookup
from qlora_supervise.supervisor.trainers.tool import Tool
from qlora_supervise.trainer_child.contract.spec import Knobs


def unmodelled(tool: Tool, config: Mapping[str, Any], model_dir: str) -> str | None:
    """Why the memory model cannot count this tool's base weights, in words; None: it can (4-bit).

    ``model_dir``: the model as the tool opens it; a model saved already quantized (its
    config.json's ``quantization_config``) is loaded as saved, whatever the tool's 4-bit keys say.
    """
    saved = saved_quantization(model_dir)
    if saved is not None and saved != _SAVED_NF4:
        return (
            f"the model is saved already quantized ({saved}); the memory model counts bitsandbytes 4-bit "
            "QLoRA weights"
        )
    why = tool.unmodelled(config, saved == _SAVED_NF4)
    if why is not None or saved == _SAVED_NF4:
        return why
    eight = tool.eight_bit(config)
    if eight is not None:
        return (
            f"the tool loads the base model in 8-bit ({eight}); the memory model counts 4-bit QLoRA weights"
        )
    # 4-bit as the config reads (an hf-script without a 4-bit flag: the script's own load, unknown).
    return None if knobs_from(tool.table, config).load_in_4bit is True else tool.unquantized


_SAVED_NF4 = "bitsandbytes 4-bit"


def model_config(model_dir: str) -> dict[str, Any]:
    """The model directory's config.json ({}: no such file, unreadable, or not a mapping)."""
    if not model_dir:
        return {}
    try:
        raw = json_loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _saved_config(model_dir: str) -> dict[str, Any] | None:
    """The model directory's ``quantization_config`` (None: none, or no readable config.json)."""
    quant = model_config(model_dir).get("quantization_config")
    return quant if isinstance(quant, dict) else None


def with_saved_4bit(knobs: Knobs, model_dir: str) -> Knobs:
    """``knobs`` as a model saved in bitsandbytes 4-bit loads: 4-bit with the saved quant type and
    double quantization, whatever the tool's own 4-bit keys say (they are not applied to it)."""
    quant = _saved_config(model_dir)
    if quant is None or _saved_as(quant) != _SAVED_NF4:
        return knobs
    kind = quant.get("bnb_4bit_quant_type")
    double = quant.get("bnb_4bit_use_double_quant")
    return dataclasses.replace(
        knobs,
        load_in_4bit=True,
        quant_type=kind if isinstance(kind, str) else "fp4",  # BitsAndBytesConfig's own defaults
        double_quant=double if isinstance(double, bool) else False,
    )


def saved_quantization(model_dir: str) -> str | None:
    """How the model directory's weights were saved quantized (None: not quantized, or unreadable):
    ``bitsandbytes 4-bit`` (a ``*-bnb-4bit`` model, which transformers loads as 4-bit without a
    BitsAndBytesConfig), else the method and its bits as config.json names them (gptq, awq, ...)."""
    quant = _saved_config(model_dir)
    return None if quant is None else _saved_as(quant)


def _saved_as(quant: Mapping[str, Any]) -> str:
    """A ``quantization_config`` in words (:func:`saved_quantization`)."""
    method = str(quant.get("quant_method") or "unknown method")
    if method == "bitsandbytes":
        if quant.get("llm_int8_skip_modules") not in (None, [], ["lm_head"]):
            # "dynamic" 4-bit uploads keep chosen layers in 16 bits: not every weight is 4-bit.
            return "bitsandbytes 4-bit with modules left unquantized (llm_int8_skip_modules)"
        if quant.get("load_in_4bit") is True:
            return _SAVED_NF4
        return "bitsandbytes 8-bit" if quant.get("load_in_8bit") is True else "bitsandbytes"
    bits = quant.get("bits")
    return f"{method}, {bits}-bit" if isinstance(bits, int) else method


#: trl's ``dtype`` values that load the unquantized parameters in 16 bits ("auto": the checkpoint's
#: own dtype, 16-bit for the models people fine-tune); its default is "float32" (ModelConfig).
_HALF_DTYPES = frozenset({"bfloat16", "float16", "auto"})


def keeps_head_dtype(tool: Tool, config: Mapping[str, Any]) -> bool:
    """Whether the tool leaves the embeddings and the LM head in a 16-bit load dtype, as our
    ``bf16_head`` knob does, instead of the fp32 our recipe's k-bit prepare casts them to.

    trl 1.16's SFTTrainer builds the LoRA model with ``get_peft_model`` and never calls
    ``prepare_model_for_kbit_training`` (trl/trainer/sft_trainer.py), so what is not 4-bit keeps
    the ``dtype`` its script loaded it in (``Tool.head_dtype_key``). Measured on the H200 (trl in
    its own process, Llama-2-7B shape, seq 1024, checkpointing, micro-batch 1 to 16): with the head
    counted in bf16, one scale of the variable part explains every peak (0.55 to 0.57); counted in
    fp32, the scales ran from 0.06 to 0.53, so one peak calibrated the next run 14 % under. axolotl
    and LLaMA-Factory are left as our recipe counts them (fp32): their peaks calibrate their own
    predictions.
    """
    key = tool.head_dtype_key
    return key is not None and lookup(config, key) in _HALF_DTYPES


def with_tool_attention(shape: ModelShape | None, trainer: Trainer) -> ModelShape | None:
    """``shape`` with the attention the trainer asks for (unchanged where it asks for none)."""
    chosen = trainer.attention()
    if shape is None or chosen is None or chosen == shape.attn_implementation:
        return shape
    return dataclasses.replace(shape, attn_implementation=chosen)
