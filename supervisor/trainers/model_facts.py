"""What a tool's config says of the model that the knobs do not. Its memory: whether the memory model
counts its weights (4-bit NF4, or fp32 as our recipe upcasts them; an 8-bit load, a bf16 LoRA or
another saved quantization get no prediction: the reactive ladder guards them), and its attention.
Its LoRA targets in our words, read the way the tool hands them to peft: names (a module whose name
ends in one), a string peft reads as a regex of the full module name (so ``q_proj,v_proj`` adapts
nothing), LLaMA-Factory's comma-separated names, or none: peft's default for the model type (read
from peft's source as text: importing peft would import torch), or every Linear layer."""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from pathlib import Path
from typing import Any

from qlora_supervise.policies.memory.families import installed_package_root
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.supervisor.facts.trainer import Trainer
from qlora_supervise.supervisor.jobfile.bounds import json_loads
from qlora_supervise.supervisor.jobfile.problems import Problem, show
from qlora_supervise.supervisor.trainers.mapping import knobs_from, lookup
from qlora_supervise.supervisor.trainers.tool import Config, Tool
from qlora_supervise.trainer_child.contract.spec import Knobs
from qlora_supervise.trainer_child.contract.targets import ALL_LINEAR, family

_SAVED_NF4 = "bitsandbytes 4-bit"
#: trl's ``dtype`` values that load the unquantized parameters in 16 bits (its default: float32).
_HALF_DTYPES = frozenset({"bfloat16", "float16", "auto"})
#: Where peft's default targets come from when trl names none (the model type's entry there).
_PEFT_DEFAULTS = "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING"
#: Where the loaded model keeps its decoder blocks: a text model, and a multimodal one's (Gemma 3).
_BLOCK_PREFIXES = ("model.layers", "model.language_model.layers")
#: Block indices a pattern is tried on (a pattern may pick some layers only: ``layers\.(1[0-5])``).
_LAYERS = 128


def unmodelled(tool: Tool, config: Config, model_dir: str) -> str | None:
    """Why the memory model cannot count this tool's base weights, in words; None: it can (4-bit).
    ``model_dir``: the model as the tool opens it; a model saved quantized is loaded as saved."""
    quant = model_config(model_dir).get("quantization_config")
    saved = _saved_as(quant) if isinstance(quant, dict) else None
    if saved is not None and saved != _SAVED_NF4:
        counts = "the memory model counts bitsandbytes 4-bit QLoRA weights"
        return f"the model is saved already quantized ({saved}); {counts}"
    if (why := tool.unmodelled(config, saved == _SAVED_NF4)) is not None or saved == _SAVED_NF4:
        return why
    if (eight := tool.eight_bit(config)) is not None:
        counts = "the memory model counts 4-bit QLoRA weights"
        return f"the tool loads the base model in 8-bit ({eight}); {counts}"
    # 4-bit as the config reads (an hf-script without a 4-bit flag: the script's own load, unknown).
    return None if knobs_from(tool.table, config).load_in_4bit is True else tool.unquantized


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
    kind = kind if isinstance(kind, str) else "fp4"  # BitsAndBytesConfig's own defaults
    double = quant.get("bnb_4bit_use_double_quant") is True
    return dataclasses.replace(knobs, load_in_4bit=True, quant_type=kind, double_quant=double)


def _saved_as(quant: Config) -> str:
    """How a model's ``quantization_config`` saved its weights: ``bitsandbytes 4-bit`` (a ``*-bnb-4bit``
    model), else the method and its bits (gptq, awq, ...)."""
    if (method := str(quant.get("quant_method") or "unknown method")) == "bitsandbytes":
        if quant.get("llm_int8_skip_modules") not in (None, [], ["lm_head"]):
            # "dynamic" 4-bit uploads keep chosen layers in 16 bits: not every weight is 4-bit.
            return "bitsandbytes 4-bit with modules left unquantized (llm_int8_skip_modules)"
        if quant.get("load_in_4bit") is True:
            return _SAVED_NF4
        return "bitsandbytes 8-bit" if quant.get("load_in_8bit") is True else "bitsandbytes"
    bits = quant.get("bits")
    return f"{method}, {bits}-bit" if isinstance(bits, int) else method


def keeps_head_dtype(tool: Tool, config: Config) -> bool:
    """Whether the tool leaves the embeddings and the LM head in a 16-bit load dtype, as our
    ``bf16_head`` knob does, instead of the fp32 our recipe's k-bit prepare casts them to: trl 1.16
    never calls ``prepare_model_for_kbit_training`` (``Tool.head_dtype_key``). Measured on the H200,
    counted so one scale explains every trl peak (0.55 to 0.57; in fp32 they ran 0.06 to 0.53)."""
    return (key := tool.head_dtype_key) is not None and lookup(config, key) in _HALF_DTYPES


def with_tool_attention(shape: ModelShape | None, trainer: Trainer) -> ModelShape | None:
    """``shape`` with the attention the trainer asks for (unchanged where it asks for none)."""
    chosen = trainer.attention()
    if shape is None or chosen is None or chosen == shape.attn_implementation:
        return shape
    return dataclasses.replace(shape, attn_implementation=chosen)


def lora_targets(tool: Tool, config: Config, model_type: str | None = None) -> tuple[str, ...] | str:
    """The LoRA targets in our words (``"all-linear"`` or module names) from the tool's spelling."""
    if _all_linear_key(tool, config):
        return ALL_LINEAR
    value = as_peft_gets_it(tool, lookup(config, tool.table.targets_key))
    if isinstance(value, str) and tool.targets_regex and value != ALL_LINEAR:
        return regex_matches(value, model_type) or value  # no match: validate says so; the string as written
    if isinstance(value, str):
        value = [name.strip() for name in value.split(",") if name.strip()]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        if len(value) == 1 and value[0] in tool.all_linear_words:
            return ALL_LINEAR
        return tuple(value)
    if tool.peft_default_targets and model_type:  # peft's default for the model type, where it has one
        found = _peft_mapping(installed_package_root("peft")).get(model_type)
        if isinstance(found, list) and found and all(isinstance(name, str) for name in found):
            return tuple(found)
    return ALL_LINEAR  # every linear layer: the most the adapter can be, so never under-counted


def as_peft_gets_it(tool: Tool, value: Any) -> Any:
    """trl's ModelConfig turns a one-name list into that name: ``[q_proj]`` reaches peft as ``"q_proj"``."""
    if tool.one_name_list_is_name and isinstance(value, list) and len(value) == 1:
        return value[0]
    return value


def _all_linear_key(tool: Tool, config: Config) -> bool:
    """axolotl's ``lora_target_linear: true``: every Linear, whatever the list says."""
    return tool.all_linear_key is not None and lookup(config, tool.all_linear_key) is True


def regex_matches(pattern: str, model_type: str | None) -> tuple[str, ...]:
    """The block's Linear layers whose full module path, as the loaded model names it, ``pattern``
    matches as peft matches it (``re.fullmatch``); () for an invalid pattern or no match."""
    try:
        compiled = re.compile(pattern)
    except re.error:
        return ()
    block = family(model_type) or family("llama")
    assert block is not None  # llama is in the table
    leaves = [(n, "self_attn") for n in block.attention] + [(n, "mlp") for n in block.mlp]
    found = (
        name
        for prefix in _BLOCK_PREFIXES
        for index in range(_LAYERS)
        for name, parent in leaves
        if compiled.fullmatch(f"{prefix}.{index}.{parent}.{name}")
    )
    return tuple(dict.fromkeys(found))


def target_problems(tool: Tool, config: Config, where: str, model_type: str | None) -> list[Problem]:
    """A string target peft would read as a pattern that adapts nothing (or cannot compile)."""
    key = tool.table.targets_key
    written = lookup(config, key)
    value = as_peft_gets_it(tool, written)
    if not tool.targets_regex or not isinstance(value, str) or value == ALL_LINEAR:
        return []
    if _all_linear_key(tool, config) or family(model_type) is None:
        return []  # every Linear; or a block the table does not know: its names cannot be checked
    names = [name for name in re.split(r"[,\s]+", value) if re.fullmatch(r"\w+", name)]
    fix = "write a list of module names, e.g. [q_proj, v_proj]"
    fix = f"write a list: [{', '.join(names)}]" if names else fix
    try:
        re.compile(value)
    except re.error as error:
        why = f"a string, which peft reads as a regular expression, and this one does not compile ({error})"
        return [Problem(f"{where}: {key}", why, show(value), fix)]
    if regex_matches(value, model_type):
        return []
    if isinstance(written, list):  # trl's one-name list
        why = (
            "a one-name list, which trl hands peft as that name alone, and peft reads a string as a "
            "regular expression of the full module name: it matches no Linear layer"
        )
        fix = f"write the pattern: '.*\\.{value}' (or name two modules or more)"
        return [Problem(f"{where}: {key}", why, show(written), fix)]
    why = (
        "a string, which peft reads as a regular expression of the full module name "
        "(model.layers.0.self_attn.q_proj), and this one matches no Linear layer: peft would stop "
        "with 'Target modules not found'"
    )
    return [Problem(f"{where}: {key}", why, show(value), fix)]


@functools.cache
def _peft_mapping(root: Path | None) -> dict[str, Any]:
    """peft's model type -> default LoRA targets, read from ``utils/constants.py`` (empty if unread)."""
    if root is None:
        return {}
    try:
        tree = ast.parse((root / "utils" / "constants.py").read_text(encoding="utf-8"))
        assigns = [node for node in tree.body if isinstance(node, ast.Assign)]
        found = next(n for n in assigns if any(getattr(t, "id", None) == _PEFT_DEFAULTS for t in n.targets))
        value = ast.literal_eval(found.value)
    except (OSError, SyntaxError, UnicodeDecodeError, StopIteration, ValueError):
        return {}
    return value if isinstance(value, dict) else {}
