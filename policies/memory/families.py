"""What differs between the decoder blocks the memory model covers, by ``config.json``'s ``model_type``, read
from transformers 5.24's ``models/*/modeling_*.py`` (the child's version) into :data:`_MODELLED`; beyond it,
Gemma 2/3 have head_dim 256 and a tied 256k vocabulary, Gemma 2 softcaps scores, and MoE experts are fused 3D
parameters bitsandbytes leaves unquantized (cast to fp32), top-k of them per token. A model type outside
:data:`BLOCKS` is not modelled (:mod:`.shape`). The attention transformers picks is read from its source as
text (importing it would import torch): SDPA when the model class sets ``_supports_sdpa = True``, a flag that
moves between releases (Gemma 2: True in 5.17, False in 5.24) while eager attention costs a factor of two at
seq 8192."""

from __future__ import annotations

import ast
import enum
import functools
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class HeadNorm(str, enum.Enum):
    """Whether queries and keys are normalised before attention, and over what width."""

    NONE = "none"
    PER_HEAD = "per_head"  # Qwen3, Gemma 3: one RMSNorm of head_dim, shared by the heads
    FULL = "full"  # OLMo 2: one RMSNorm over the whole q (and kv) width


@dataclass(frozen=True)
class Block:
    """One decoder block's facts beyond its sizes."""

    norms: int = 2  # hidden-wide RMSNorms per block
    head_norm: HeadNorm = HeadNorm.NONE
    fused: bool = False  # Phi-3: qkv_proj and gate_up_proj
    moe: bool = False  # fused 3D experts and a bare router instead of a Linear MLP
    # Gemma's RMSNorm casts back to its input's dtype (``type_as``), so the residual stream stays
    # bf16 with the bf16 head; Llama's turns fp32 at the first norm (H200 host bench: 2 bytes vs 4).
    norm_keeps_dtype: bool = False


LLAMA = Block()
#: ``model_type`` -> its block and the ``architectures`` entry of its causal-LM class, for every
#: model type the memory model predicts.
_MODELLED: dict[str, tuple[Block, str]] = {
    "llama": (LLAMA, "LlamaForCausalLM"),
    "mistral": (LLAMA, "MistralForCausalLM"),
    "qwen2": (LLAMA, "Qwen2ForCausalLM"),
    "qwen3": (Block(head_norm=HeadNorm.PER_HEAD), "Qwen3ForCausalLM"),
    "olmo2": (Block(head_norm=HeadNorm.FULL), "Olmo2ForCausalLM"),
    "gemma2": (Block(norms=4, norm_keeps_dtype=True), "Gemma2ForCausalLM"),
    "gemma3_text": (Block(norms=4, head_norm=HeadNorm.PER_HEAD, norm_keeps_dtype=True), "Gemma3ForCausalLM"),
    "phi3": (Block(fused=True), "Phi3ForCausalLM"),
    "qwen3_moe": (Block(head_norm=HeadNorm.PER_HEAD, moe=True), "Qwen3MoeForCausalLM"),
    "mixtral": (Block(moe=True), "MixtralForCausalLM"),
}
BLOCKS: dict[str, Block] = {model_type: block for model_type, (block, _) in _MODELLED.items()}
ARCHITECTURES: dict[str, str] = {name: model_type for model_type, (_, name) in _MODELLED.items()}
#: Model types whose q/k/v projections carry a bias without saying so in config.json.
QKV_BIAS = frozenset({"qwen2"})


def model_type_of(config: Mapping[str, Any]) -> str:
    """config.json's ``model_type``; for one that names only a modelled architecture, its type;
    for neither, ``llama`` (such a config has always been read as a Llama)."""
    architectures = config.get("architectures") or []
    first = architectures[0] if isinstance(architectures, list) and architectures else None
    if config.get("model_type"):
        return str(config["model_type"])
    return ARCHITECTURES.get(str(first), "") if first is not None else "llama"


def facts_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """The architecture facts of :class:`ModelShape`, from config.json's keys."""
    model_type = model_type_of(config)
    window, sliding = _window(config, int(config["num_hidden_layers"]))
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    expert_width = config.get("moe_intermediate_size") or config.get("intermediate_size") or 0
    return {
        "model_type": model_type,
        "attn_implementation": default_attention(model_type),
        "attn_softcap": _float_or_none(config.get("attn_logit_softcapping")),
        "final_softcap": _float_or_none(config.get("final_logit_softcapping")),
        "qkv_bias": bool(config.get("attention_bias")) or model_type in QKV_BIAS,
        "sliding_window": window,
        "sliding_layers": sliding,
        "experts": experts,
        "experts_per_token": int(config.get("num_experts_per_tok") or 0) if experts else 0,
        "expert_intermediate": int(expert_width) if experts else 0,
        "router_logits": bool(experts and config.get("output_router_logits")),
    }


def _window(config: Mapping[str, Any], layers: int) -> tuple[int | None, int]:
    """The sliding window and how many layers use it: by ``layer_types``, else Gemma's pattern,
    Qwen's ``use_sliding_window`` switch, else Mistral/Phi-3's window on every layer."""
    if not (window := config.get("sliding_window")):
        return None, 0
    types = config.get("layer_types")
    if isinstance(types, list) and types:
        sliding = sum(1 for kind in types if kind == "sliding_attention")
    elif model_type_of(config) in ("gemma2", "gemma3_text", "gemma3"):
        # transformers' default: Gemma 2 alternates (sliding first), Gemma 3 slides 5 layers of 6.
        pattern = 2 if model_type_of(config) == "gemma2" else int(config.get("sliding_window_pattern") or 6)
        sliding = sum(1 for i in range(layers) if (i + 1) % pattern)
    elif "use_sliding_window" in config:
        below = int(config.get("max_window_layers") or 0)
        sliding = max(0, layers - below) if config["use_sliding_window"] else 0
    else:
        sliding = layers
    return (int(window), sliding) if sliding else (None, 0)


def _float_or_none(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value else None


#: The transformers folder of a model type whose modeling module is named for another one.
MODULE_OF = {"gemma3_text": "gemma3"}
#: Eager where transformers' source cannot be read: the child's pinned release (5.24) says so.
EAGER_WITHOUT_SOURCE = frozenset({"gemma2"})


def default_attention(model_type: str) -> str:
    """``"sdpa"`` or ``"eager"``: what transformers picks for ``model_type`` when asked for none."""
    if (supports := _supports_sdpa(_transformers_root(), MODULE_OF.get(model_type, model_type))) is None:
        return "eager" if model_type in EAGER_WITHOUT_SOURCE else "sdpa"
    return "sdpa" if supports else "eager"


def _transformers_root() -> Path | None:  # a seam the tests replace
    return installed_package_root("transformers")


@functools.cache
def installed_package_root(name: str) -> Path | None:
    """The installed package's folder, found without importing it (its source is read as text)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def _supports_sdpa(root: Path | None, module: str) -> bool | None:
    """``_supports_sdpa`` of ``models/<module>/modeling_<module>.py``'s ``*PreTrainedModel`` class;
    None when that file cannot be read; False when it sets nothing (``PreTrainedModel``'s default)."""
    if root is None:
        return None
    path = root / "models" / module / f"modeling_{module}.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    return bool(supports_sdpa_in(tree))


def supports_sdpa_in(tree: ast.Module) -> bool | None:
    """The constant a ``*PreTrainedModel`` class in ``tree`` assigns to ``_supports_sdpa``."""
    classes = [node for node in tree.body if isinstance(node, ast.ClassDef)]
    for statement in (s for c in classes if c.name.endswith("PreTrainedModel") for s in c.body):
        if isinstance(statement, (ast.Assign, ast.AnnAssign)):
            targets = statement.targets if isinstance(statement, ast.Assign) else [statement.target]
            value = statement.value
            named = any(isinstance(t, ast.Name) and t.id == "_supports_sdpa" for t in targets)
            if named and isinstance(value, ast.Constant) and isinstance(value.value, bool):
                return value.value
    return None
