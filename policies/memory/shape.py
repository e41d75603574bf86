"""What the memory model needs to know about a model, read from its ``config.json`` alone.

The model covers Llama-family decoders (``LlamaForCausalLM`` and the architectures with the
same block: RMSNorm, rotary attention with optional grouped-query heads, a gated SiLU MLP,
an untied or tied LM head). Anything else is refused with a typed :class:`Unsupported`
reason, because a number computed for the wrong block would be confidently wrong.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

#: Architectures whose decoder block is the Llama block (same linear layers, same norms, same MLP).
LLAMA_FAMILY = frozenset(
    {
        "LlamaForCausalLM",
        "MistralForCausalLM",
        "Qwen2ForCausalLM",
        "Qwen3ForCausalLM",
        "Olmo2ForCausalLM",
    }
)
#: config.json keys that mean mixture-of-experts (the MLP term would be off by the expert count).
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
#: The linear layers of one decoder block, by the names target_modules uses.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
LINEAR_MODULES = ATTENTION_MODULES + MLP_MODULES


class UnsupportedReason(str, enum.Enum):
    """Why a config is outside what the memory model covers."""

    NOT_LLAMA_FAMILY = "not_llama_family"
    MIXTURE_OF_EXPERTS = "mixture_of_experts"
    MISSING_FIELD = "missing_field"
    BAD_VALUE = "bad_value"


@dataclass(frozen=True)
class Unsupported:
    """A config the memory model does not cover, and in words why."""

    reason: UnsupportedReason
    detail: str


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a Llama-family decoder that memory depends on."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None  # None: hidden // heads

    @classmethod
    def read(cls, config: Mapping[str, Any]) -> ModelShape | Unsupported:
        """The shape of ``config`` (a parsed ``config.json``), or why it is not modelled."""
        architectures = config.get("architectures") or []
        if isinstance(architectures, list) and architectures:
            unknown = [a for a in architectures if a not in LLAMA_FAMILY]
            if unknown:
                return Unsupported(
                    UnsupportedReason.NOT_LLAMA_FAMILY,
                    f"architecture {unknown[0]} is not a Llama-family decoder "
                    f"(modelled: {', '.join(sorted(LLAMA_FAMILY))})",
                )
        moe = [key for key in MOE_KEYS if config.get(key)]
        if moe:
            return Unsupported(
                UnsupportedReason.MIXTURE_OF_EXPERTS,
                f"{moe[0]}={config[moe[0]]}: mixture-of-experts MLPs are not modelled",
            )
        missing = [k for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
                   if k not in config]  # fmt: skip
        if missing:
            return Unsupported(UnsupportedReason.MISSING_FIELD, f"config.json has no {', '.join(missing)}")
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            shape = cls(
                hidden=hidden,
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                intermediate=int(config.get("intermediate_size") or 4 * hidden),
                vocab=int(config["vocab_size"]),
                tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
                head_dim=int(config["head_dim"]) if config.get("head_dim") else None,
            )
        except (TypeError, ValueError) as error:
            return Unsupported(UnsupportedReason.BAD_VALUE, f"config.json: {error}")
        if min(shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.intermediate, shape.vocab) <= 0:
            return Unsupported(UnsupportedReason.BAD_VALUE, "config.json: sizes must be positive")
        return shape

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape | None:
        """None when the config is outside the model (see :meth:`read` for the reason)."""
        shape = cls.read(config)
        return shape if isinstance(shape, ModelShape) else None

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def q_dim(self) -> int:
        return self.heads * self.dim_per_head

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.dim_per_head

    def linear_dims(self) -> dict[str, tuple[int, int]]:
        """``{module: (in_features, out_features)}`` of one decoder block."""
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (h, self.q_dim),
            "k_proj": (h, self.kv_dim),
            "v_proj": (h, self.kv_dim),
            "o_proj": (self.q_dim, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    @property
    def layer_params(self) -> int:
        """Parameters of the linear layers of one block (the part that is quantized)."""
        return sum(a * b for a, b in self.linear_dims().values())

    @property
    def embedding_params(self) -> int:
        """Input embeddings plus the LM head (one matrix when tied)."""
        return self.vocab * self.hidden * (1 if self.tie_word_embeddings else 2)

    @property
    def norm_params(self) -> int:
        return (2 * self.layers + 1) * self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.embedding_params + self.norm_params


def resolve_targets(targets: tuple[str, ...] | str) -> tuple[str, ...]:
    """The block's linear layers a LoRA ``target_modules`` value adapts.

    ``all-linear`` is every linear layer except the LM head (peft's rule); a regex or an unknown
    name adapts what it matches among the block's layers, so it is read as a list of names.
    """
    if isinstance(targets, str):
        if targets == "all-linear":
            return LINEAR_MODULES
        return tuple(name for name in LINEAR_MODULES if name in targets)
    return tuple(name for name in targets if name in LINEAR_MODULES)
