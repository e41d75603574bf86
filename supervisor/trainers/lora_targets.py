"""A tool's LoRA targets in our words, read the way the tool hands them to peft: names (a module whose
name ends in one), a string peft reads as a regex of the full module name (so ``q_proj,v_proj`` adapts
nothing), LLaMA-Factory's comma-separated names, or none: peft's default for the model type (read
from peft's source as text: importing peft would import torch), or every Linear layer."""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qlora_supervise.policies.memory.families import installed_package_root
from qlora_supervise.supervisor.jobfile.problems import Problem, show
from qlora_supervise.supervisor.trainers.mapping import lookup
from qlora_supervise.supervisor.trainers.tool import Tool
from qlora_supervise.trainer_child.contract.targets import ALL_LINEAR, family

#: Where peft's default targets come from when trl names none (the model type's entry there).
_PEFT_DEFAULTS = "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING"


def lora_targets(
    tool: Tool, config: Mapping[str, Any], model_type: str | None = None
) -> tuple[str, ...] | str:
    """The LoRA targets in our words (``"all-linear"`` or module names) from the tool's spelling."""
    if _all_linear_key(tool, config):
        return ALL_LINEAR
    value = as_peft_gets_it(tool, lookup(config, tool.table.targets_key))
    if isinstance(value, str) and tool.targets_regex and value != ALL_LINEAR:
        matched = regex_matches(value, model_type)
        return matched if matched else value  # no match: validate says so; the string as written
    if isinstance(value, str):
        value = [name.strip() for name in value.split(",") if name.strip()]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        if len(value) == 1 and value[0] in tool.all_linear_words:
            return ALL_LINEAR
        return tuple(value)
    if tool.peft_default_targets:
        defaults = peft_default_targets(model_type)
        if defaults:
            return defaults
    return ALL_LINEAR  # every linear layer: the most the adapter can be, so never under-counted


def as_peft_gets_it(tool: Tool, value: Any) -> Any:
    """trl's ModelConfig turns a one-name list into that name: ``[q_proj]`` reaches peft as ``"q_proj"``."""
    if tool.one_name_list_is_name and isinstance(value, list) and len(value) == 1:
        return value[0]
    return value


def _all_linear_key(tool: Tool, config: Mapping[str, Any]) -> bool:
    """axolotl's ``lora_target_linear: true``: every Linear, whatever the list says."""
    return tool.all_linear_key is not None and lookup(config, tool.all_linear_key) is True


def regex_matches(pattern: str, model_type: str | None) -> tuple[str, ...]:
    """The block's Linear layers whose full module path ``pattern`` matches as peft matches it
    (``re.fullmatch``); () for an invalid pattern or no match."""
    try:
        compiled = re.compile(pattern)
    except re.error:
        return ()
    return tuple(dict.fromkeys(name for name, path in _block_paths(model_type) if compiled.fullmatch(path)))


def target_problems(
    tool: Tool, config: Mapping[str, Any], where: str, model_type: str | None
) -> list[Problem]:
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


#: Where the loaded model keeps its decoder blocks: a text model, and a multimodal one's (Gemma 3).
_BLOCK_PREFIXES = ("model.layers", "model.language_model.layers")
#: Block indices a pattern is tried on (a pattern may pick some layers only: ``layers\.(1[0-5])``).
_LAYERS = 128


def _block_paths(model_type: str | None) -> list[tuple[str, str]]:
    """(leaf, full path) of the decoder blocks' Linear layers, as the loaded model names them."""
    block = family(model_type) or family("llama")
    assert block is not None  # llama is in the table
    leaves = [(n, "self_attn") for n in block.attention] + [(n, "mlp") for n in block.mlp]
    return [
        (name, f"{prefix}.{index}.{parent}.{name}")
        for prefix in _BLOCK_PREFIXES
        for index in range(_LAYERS)
        for name, parent in leaves
    ]


def peft_default_targets(model_type: str | None) -> tuple[str, ...] | None:
    """peft's default ``target_modules`` for ``model_type`` (None: unknown type, a pattern, no peft)."""
    if not model_type:
        return None
    found = _peft_mapping(installed_package_root("peft")).get(model_type)
    return tuple(found) if isinstance(found, list) and all(isinstance(n, str) for n in found) else None


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
