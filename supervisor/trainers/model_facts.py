"""What a tool's config says of the model's memory that the knobs do not: whether the memory model
counts its weights (4-bit NF4, or fp32 as our recipe upcasts them; an 8-bit load, a bf16 LoRA or
another saved quantization get no prediction: the reactive ladder guards them), and its attention."""

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
    ``model_dir``: the model as the tool opens it; a model saved quantized is loaded as saved."""
    saved = saved_quantization(model_dir)
    if saved is not None and saved != _SAVED_NF4:
        counts = "the memory model counts bitsandbytes 4-bit QLoRA weights"
        return f"the model is saved already quantized ({saved}); {counts}"
    why = tool.unmodelled(config, saved == _SAVED_NF4)
    if why is not None or saved == _SAVED_NF4:
        return why
    if (eight := tool.eight_bit(config)) is not None:
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


def with_saved_4bit(knobs: Knobs, model_dir: str) -> Knobs:
    """``knobs`` as a model saved in bitsandbytes 4-bit loads: 4-bit with the saved quant type and
    double quantization, whatever the tool's own 4-bit keys say (they are not applied to it)."""
    quant = model_config(model_dir).get("quantization_config")
    if not isinstance(quant, dict) or _saved_as(quant) != _SAVED_NF4:
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
    ``bitsandbytes 4-bit`` (a ``*-bnb-4bit`` model), else the method and its bits (gptq, awq, ...)."""
    quant = model_config(model_dir).get("quantization_config")
    return _saved_as(quant) if isinstance(quant, dict) else None


def _saved_as(quant: Mapping[str, Any]) -> str:
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


#: trl's ``dtype`` values that load the unquantized parameters in 16 bits (its default: float32).
_HALF_DTYPES = frozenset({"bfloat16", "float16", "auto"})


def keeps_head_dtype(tool: Tool, config: Mapping[str, Any]) -> bool:
    """Whether the tool leaves the embeddings and the LM head in a 16-bit load dtype, as our
    ``bf16_head`` knob does, instead of the fp32 our recipe's k-bit prepare casts them to: trl 1.16
    never calls ``prepare_model_for_kbit_training`` (``Tool.head_dtype_key``). Measured on the H200,
    counted so one scale explains every trl peak (0.55 to 0.57; in fp32 they ran 0.06 to 0.53)."""
    key = tool.head_dtype_key
    return key is not None and lookup(config, key) in _HALF_DTYPES


def with_tool_attention(shape: ModelShape | None, trainer: Trainer) -> ModelShape | None:
    """``shape`` with the attention the trainer asks for (unchanged where it asks for none)."""
    chosen = trainer.attention()
    if shape is None or chosen is None or chosen == shape.attn_implementation:
        return shape
    return dataclasses.replace(shape, attn_implementation=chosen)
