"""What the memory model needs to know about a model, read from its ``config.json`` alone.

The model covers Llama-family decoders (``LlamaForCausalLM`` and the architectures with the
same block: RMSNorm, rotary attention with optional grouped-query heads, a gated SiLU MLP,
an untied or tied LM head). Anything else is refused with a typed :class:`Unsupported`
reason, because a number computed for the wrong block would be confidently wrong.

The architecture facts are read for every family the LoRA targets table knows
(:data:`...contract.targets.FAMILIES`: Gemma 2/3, Phi-3, the MoE models too), so ``plan`` can say
what such a model is and which memory terms it would need (:meth:`ModelShape.missing_terms`)
even while it refuses to predict it; a model type outside that table is not read at all.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from qlora_supervise.trainer_child.contract.targets import FAMILIES, KEYWORDS, resolve

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
#: ``model_type`` of each modelled architecture, for a config.json that names only the architecture.
_TYPE_OF = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Olmo2ForCausalLM": "olmo2",
}
#: Model types whose attention transformers 5.24 runs eagerly when the child asks for none (it
#: asks for none): Gemma 2 sets ``_supports_sdpa = False`` because SDPA cannot softcap the scores.
#: Everything else gets SDPA; flash or flex attention only when asked for.
EAGER_ATTENTION = frozenset({"gemma2"})
#: Model types whose q/k/v projections carry a bias without saying so in config.json.
QKV_BIAS = frozenset({"qwen2"})
#: A vocabulary this large makes the logits (batch x seq x vocab, fp32 in the loss) the peak.
LARGE_VOCAB = 200_000
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
    """A config the memory model does not cover, and in words why; ``shape``: its architecture
    facts where its block is one the targets table knows (None: not read)."""

    reason: UnsupportedReason
    detail: str
    shape: ModelShape | None = None


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
    # The architecture facts (issue 20): what the block is beyond its sizes. Defaults are the
    # Llama block's, so a shape built from sizes alone stays the Llama one.
    model_type: str = "llama"
    attn_implementation: str = "sdpa"  # what the child gets: see EAGER_ATTENTION
    attn_softcap: float | None = None  # tanh softcapping of the attention scores (Gemma 2)
    final_softcap: float | None = None  # ... and of the logits (Gemma 2)
    qkv_bias: bool = False
    sliding_window: int | None = None  # tokens; None: every layer attends to the whole sequence
    sliding_layers: int = 0  # how many layers use the window
    experts: int = 0  # MoE: experts per layer (0: a dense MLP)
    experts_per_token: int = 0  # MoE: routed per token (top-k)
    expert_intermediate: int = 0  # MoE: one expert's MLP width
    router_logits: bool = False  # MoE: the auxiliary loss keeps every layer's router logits

    @classmethod
    def read(cls, config: Mapping[str, Any]) -> ModelShape | Unsupported:
        """The shape of ``config`` (a parsed ``config.json``), or why it is not modelled.

        A config outside the Llama family is refused; where its block is one the targets table
        knows, the refusal carries its facts (:attr:`Unsupported.shape`) and the terms it lacks.
        """
        architectures = config.get("architectures") or []
        if isinstance(architectures, list) and architectures:
            unknown = [a for a in architectures if a not in LLAMA_FAMILY]
            if unknown:
                return _not_llama(str(unknown[0]), config)
        moe = [key for key in MOE_KEYS if config.get(key)]
        if moe:
            return Unsupported(
                UnsupportedReason.MIXTURE_OF_EXPERTS,
                f"{moe[0]}={config[moe[0]]}: mixture-of-experts MLPs are not modelled",
            )
        return cls._sizes(config)

    @classmethod
    def architecture(cls, config: Mapping[str, Any]) -> ModelShape | Unsupported:
        """The sizes and architecture facts of any family the targets table knows, modelled or
        not (see :meth:`missing_terms`); Unsupported for another model type or a broken config."""
        model_type = _model_type(config)
        if model_type not in FAMILIES:
            known = ", ".join(sorted(FAMILIES))
            return Unsupported(
                UnsupportedReason.NOT_LLAMA_FAMILY,
                f"model_type {model_type!r} is none of the families read ({known})",
            )
        return cls._sizes(config)

    @classmethod
    def _sizes(cls, config: Mapping[str, Any]) -> ModelShape | Unsupported:
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
                **_facts(config),
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

    def sizes(self) -> dict[str, Any]:
        """The eight sizes alone: the per-host peak store's key, as it was before the facts existed."""
        return {name: getattr(self, name) for name in _SIZE_FIELDS}

    def missing_terms(self) -> tuple[str, ...]:
        """The memory terms this model needs that the Llama-family model lacks (empty: none)."""
        terms = []
        if self.attn_implementation == "eager":
            terms.append(
                "eager attention scores (micro x heads x seq^2 per layer: scores, tanh, fp32 softmax)"
            )
        if self.final_softcap:
            terms.append("softcapped logits (inside trl's fused-head tiles: to measure)")
        if self.vocab >= LARGE_VOCAB:
            terms.append(f"{self.vocab}-token logits in fp32 (fused-head slices, eval) at that vocabulary")
        if self.experts:
            # transformers 5 fuses the experts into 3D parameters bitsandbytes does not quantize,
            # and peft's k-bit prepare casts every such parameter to fp32.
            terms.append(f"{self.experts} resident experts per layer, unquantized and cast to fp32")
            terms.append(
                "router logits kept for the auxiliary loss" if self.router_logits else "routing buffers"
            )
        block = FAMILIES.get(self.model_type)
        if block is not None and block.attention != ATTENTION_MODULES:
            terms.append(f"LoRA on fused {', '.join(block.linear)}")
        return tuple(terms)

    def describe(self) -> str:
        """The architecture in one line for a person: what ``plan`` read."""
        parts = [f"{self.model_type}: {self.attn_implementation} attention"]
        if self.attn_softcap:
            parts.append(f"scores softcapped at {self.attn_softcap:g}")
        if self.head_dim and self.head_dim != self.hidden // self.heads:
            parts.append(f"head_dim {self.head_dim} (hidden/heads {self.hidden // self.heads})")
        parts.append(f"vocab {self.vocab} {'tied' if self.tie_word_embeddings else 'untied'}")
        if self.final_softcap:
            parts.append(f"logits softcapped at {self.final_softcap:g}")
        if self.qkv_bias:
            parts.append("qkv bias")
        if self.sliding_window:
            parts.append(
                f"sliding window {self.sliding_window} on {self.sliding_layers} of {self.layers} layers"
            )
        if self.experts:
            parts.append(
                f"{self.experts} experts, top-{self.experts_per_token}, width {self.expert_intermediate}"
            )
        return ", ".join(parts)

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


_SIZE_FIELDS = (
    "hidden",
    "layers",
    "heads",
    "kv_heads",
    "intermediate",
    "vocab",
    "tie_word_embeddings",
    "head_dim",
)


def _model_type(config: Mapping[str, Any]) -> str:
    """config.json's ``model_type``; for one that names only a Llama-family architecture, its
    type; for neither, ``llama`` (such a config has always been read as a Llama)."""
    architectures = config.get("architectures") or []
    first = architectures[0] if isinstance(architectures, list) and architectures else None
    if config.get("model_type"):
        return str(config["model_type"])
    return _TYPE_OF.get(str(first), "") if first is not None else "llama"


def _facts(config: Mapping[str, Any]) -> dict[str, Any]:
    """The architecture facts of :class:`ModelShape`, from config.json's keys."""
    model_type = _model_type(config)
    layers = int(config["num_hidden_layers"])
    window, sliding = _window(config, layers)
    experts = int(config.get("num_local_experts") or config.get("num_experts") or 0)
    return {
        "model_type": model_type,
        "attn_implementation": "eager" if model_type in EAGER_ATTENTION else "sdpa",
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
    them (Gemma 2/3, and transformers 5's Qwen), Qwen's ``use_sliding_window`` switch (off in the
    released models), else Mistral/Phi-3's window on every layer."""
    window = config.get("sliding_window")
    if not window:
        return None, 0
    types = config.get("layer_types")
    if isinstance(types, list) and types:
        sliding = sum(1 for kind in types if kind == "sliding_attention")
    elif "use_sliding_window" in config:
        sliding = (
            max(0, layers - int(config.get("max_window_layers") or 0)) if config["use_sliding_window"] else 0
        )
    else:
        sliding = layers
    return (int(window), sliding) if sliding else (None, 0)


def _float_or_none(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value else None


def _not_llama(architecture: str, config: Mapping[str, Any]) -> Unsupported:
    """The refusal of a non-Llama architecture: with its facts and lacking terms where its block is
    known, else why nothing is read."""
    modelled = ", ".join(sorted(LLAMA_FAMILY))
    facts = ModelShape.architecture(config)
    if not isinstance(facts, ModelShape):
        return Unsupported(
            UnsupportedReason.NOT_LLAMA_FAMILY,
            f"architecture {architecture} is not a Llama-family decoder (modelled: {modelled}); "
            f"{facts.detail}, so its attention, MLP and head are not read and no term would be right",
        )
    terms = "; ".join(facts.missing_terms()) or "none known to differ, but the block is unmeasured on a card"
    return Unsupported(
        UnsupportedReason.NOT_LLAMA_FAMILY,
        f"architecture {architecture} ({facts.describe()}) is not a Llama-family decoder; "
        f"the memory model has no terms yet for: {terms}",
        shape=facts,
    )


def resolve_targets(targets: tuple[str, ...] | str) -> tuple[str, ...]:
    """The block's linear layers a LoRA ``target_modules`` value adapts.

    ``all-linear`` is every linear layer except the LM head (peft's rule); a regex or an unknown
    name adapts what it matches among the block's layers, so it is read as a list of names.
    """
    if isinstance(targets, str):
        if targets in KEYWORDS:  # attention / mlp / all-linear: the modelled block is the Llama one
            return tuple(resolve(targets, "llama"))
        return tuple(name for name in LINEAR_MODULES if name in targets)
    return tuple(name for name in targets if name in LINEAR_MODULES)
