"""What differs between the decoder blocks the memory model covers, by ``config.json``'s ``model_type``.

Read from transformers 5.24's ``models/*/modeling_*.py`` (the version the child runs):

* **Llama, Mistral, Qwen2**: two RMSNorms a block (before attention, before the MLP), separate
  q/k/v/o projections, a gated SiLU MLP (gate, up, down). Qwen2 adds a bias to q/k/v.
* **Qwen3** (and **Qwen3-MoE**): the Llama block plus an RMSNorm over each head's query and key
  (``q_norm``/``k_norm``, head_dim wide, applied to the projections' fp32 outputs).
* **Gemma 2 / Gemma 3 (text)**: four RMSNorms a block (before *and after* attention and the MLP),
  a tanh-GELU gated MLP with the same three intermediates as SiLU's, embeddings scaled by
  sqrt(hidden) and tied to the head at a 256k vocabulary, head_dim 256 (not hidden/heads).
  Gemma 2 softcaps the attention scores, which SDPA cannot: transformers 5.24 sets
  ``_supports_sdpa = False``, so it trains with eager attention, keeping seq^2 tensors per head
  and layer, while 5.17 runs SDPA without the softcap (:mod:`.attention` reads which, from the
  installed source). Gemma 3 has q/k norms instead and trains with SDPA. Both softcap or scale
  the logits inside trl's fused head tiles.
* **Phi-3 / Phi-4-mini**: the Llama block with q/k/v fused into ``qkv_proj`` and gate/up into
  ``gate_up_proj`` (same weights, other shapes for LoRA).
* **Qwen3-MoE, Mixtral**: attention as above; the MLP is ``E`` experts stored as two fused 3D
  parameters, which bitsandbytes does not quantize (they are not ``nn.Linear``) and peft's k-bit
  prepare casts to fp32, and a router (``gate``, a bare ``E x h`` parameter, fp32 too). Every
  expert is resident; each token runs through ``top-k`` of them.

A model type outside :data:`BLOCKS` is not modelled: ``plan`` says so and why (:mod:`.shape`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .attention import default_attention


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
    scaled_embeddings: bool = False  # Gemma: the embedding output times sqrt(hidden)
    # Gemma's RMSNorm casts its output back to its input's dtype (``type_as``), so the residual
    # stream stays in the embeddings' dtype: bf16 with the bf16 head. Llama's multiplies by its fp32
    # weight and the stream turns fp32 at the first norm (H200, host bench: a Gemma 3 block input
    # offloaded at 2 bytes a value, the Llama, Qwen3 and Phi-3 ones at 4).
    norm_keeps_dtype: bool = False


LLAMA = Block()
QWEN3 = Block(head_norm=HeadNorm.PER_HEAD)
GEMMA2 = Block(norms=4, scaled_embeddings=True, norm_keeps_dtype=True)
GEMMA3 = Block(norms=4, head_norm=HeadNorm.PER_HEAD, scaled_embeddings=True, norm_keeps_dtype=True)

#: ``model_type`` -> its block, for every model type the memory model predicts.
BLOCKS: dict[str, Block] = {
    "llama": LLAMA,
    "mistral": LLAMA,
    "qwen2": LLAMA,
    "qwen3": QWEN3,
    "olmo2": Block(head_norm=HeadNorm.FULL),
    "gemma2": GEMMA2,
    "gemma3_text": GEMMA3,
    "phi3": Block(fused=True),
    "qwen3_moe": Block(head_norm=HeadNorm.PER_HEAD, moe=True),
    "mixtral": Block(moe=True),
}

#: The ``architectures`` entry of each modelled model type's causal-LM class.
ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Olmo2ForCausalLM": "olmo2",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3_text",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}

#: Model types whose q/k/v projections carry a bias without saying so in config.json.
QKV_BIAS = frozenset({"qwen2"})


def block(model_type: str) -> Block | None:
    """The block of ``model_type``; None when the memory model does not cover it."""
    return BLOCKS.get(model_type)


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
    layers = int(config["num_hidden_layers"])
    window, sliding = _window(config, layers)
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
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
        "expert_intermediate": int(
            config.get("moe_intermediate_size") or config.get("intermediate_size") or 0
        )
        if experts
        else 0,
        "router_logits": bool(config.get("output_router_logits")) if experts else False,
    }


def _window(config: Mapping[str, Any], layers: int) -> tuple[int | None, int]:
    """The sliding window and how many layers use it: ``layer_types`` where the config lists
    them (Gemma 2/3, and transformers 5's Qwen), else Gemma's own pattern, Qwen's
    ``use_sliding_window`` switch (off in the released models), else Mistral/Phi-3's window on
    every layer."""
    window = config.get("sliding_window")
    if not window:
        return None, 0
    types = config.get("layer_types")
    if isinstance(types, list) and types:
        sliding = sum(1 for kind in types if kind == "sliding_attention")
    elif model_type_of(config) in ("gemma2", "gemma3_text", "gemma3"):
        # transformers' own default when config.json lists no layer_types: Gemma 2 alternates
        # (sliding first), Gemma 3 slides on 5 layers of every 6 (sliding_window_pattern).
        pattern = 2 if model_type_of(config) == "gemma2" else int(config.get("sliding_window_pattern") or 6)
        sliding = sum(1 for i in range(layers) if (i + 1) % pattern)
    elif "use_sliding_window" in config:
        sliding = (
            max(0, layers - int(config.get("max_window_layers") or 0)) if config["use_sliding_window"] else 0
        )
    else:
        sliding = layers
    return (int(window), sliding) if sliding else (None, 0)


def _float_or_none(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value else None
