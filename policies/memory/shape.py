"""What the memory model needs to know about a model, read from its ``config.json`` alone. The blocks of
:data:`.families.BLOCKS` are modelled; anything else is refused with a typed :class:`Unsupported` reason (a
number for the wrong block would be confidently wrong), with its facts where the LoRA targets table knows the
family. A multimodal Gemma 3 is refused for its vision tower. The blocks' facts are in :mod:`.families`."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, TypeAlias

from qlora_supervise.policies.memory import families
from qlora_supervise.policies.memory.families import BLOCKS, Block, HeadNorm, facts_of, model_type_of
from qlora_supervise.trainer_child.contract.targets import FAMILIES, KEYWORDS, resolve

#: config.json keys that mean mixture-of-experts.
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")
#: A vocabulary this large makes the logits (batch x seq x vocab, fp32 in the loss) the peak.
LARGE_VOCAB = 200_000
#: The attention's linear layers of one decoder block, by the names target_modules uses.
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
#: A LoRA ``target_modules`` value: a keyword of the family's table, a regex, or module names.
Targets: TypeAlias = tuple[str, ...] | str


class UnsupportedReason(str, enum.Enum):
    """Why a config is outside what the memory model covers."""

    NOT_MODELLED = "not_modelled"
    MULTIMODAL = "multimodal"
    MIXTURE_OF_EXPERTS = "mixture_of_experts"
    MISSING_FIELD = "missing_field"
    BAD_VALUE = "bad_value"


@dataclass(frozen=True)
class Unsupported:
    """A config the memory model does not cover, and why; ``shape``: its architecture facts where
    the targets table knows its block (None: not read)."""

    reason: UnsupportedReason
    detail: str
    shape: ModelShape | None = None


@dataclass(frozen=True)
class ModelShape:
    """The sizes of a decoder that memory depends on (the first eight fields), and its
    architecture facts, whose defaults are the Llama block's."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tie_word_embeddings: bool = False
    head_dim: int | None = None  # None: hidden // heads
    model_type: str = "llama"
    attn_implementation: str = "sdpa"  # what the child gets: see attention.default_attention
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
        """The shape of ``config`` (a parsed ``config.json``), or why it is not modelled."""
        if isinstance(config.get("text_config"), Mapping) and "hidden_size" not in config:
            facts = cls.architecture(config)
            return Unsupported(
                UnsupportedReason.MULTIMODAL,
                f"model_type {model_type_of(config)!r} is multimodal: its vision tower is loaded and "
                "quantized beside the language model and is not modelled (its text_config is read "
                "for the facts); train a text-only checkpoint of it to get a prediction",
                shape=facts if isinstance(facts, ModelShape) else None,
            )
        architectures = config.get("architectures") or []
        if isinstance(architectures, list) and architectures:
            unknown = [a for a in architectures if a not in families.ARCHITECTURES]
            if unknown:
                return _not_modelled(str(unknown[0]), config)
        if (model_type := model_type_of(config)) not in BLOCKS:
            return _not_modelled(model_type, config)
        moe = [key for key in MOE_KEYS if config.get(key)]
        if moe and not BLOCKS[model_type].moe:
            detail = f"{moe[0]}={config[moe[0]]} on a {model_type} block: its experts are not modelled"
            return Unsupported(UnsupportedReason.MIXTURE_OF_EXPERTS, detail)
        return cls._sizes(config)

    @classmethod
    def architecture(cls, config: Mapping[str, Any]) -> ModelShape | Unsupported:
        """The sizes and facts of any family the targets table knows, modelled or not; Unsupported
        for another model type or a broken config. A multimodal one is read from its text_config."""
        if (model_type := model_type_of(config)) not in FAMILIES:
            detail = f"model_type {model_type!r} is none of the families read ({', '.join(sorted(FAMILIES))})"
            return Unsupported(UnsupportedReason.NOT_MODELLED, detail)
        text = config.get("text_config")
        if isinstance(text, Mapping) and "hidden_size" not in config:
            return cls._sizes({"model_type": f"{model_type}_text", **text})
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
                **facts_of(config),
            )
        except (TypeError, ValueError) as error:
            return Unsupported(UnsupportedReason.BAD_VALUE, f"config.json: {error}")
        if min(shape.hidden, shape.layers, shape.heads, shape.kv_heads, shape.intermediate, shape.vocab) <= 0:
            return Unsupported(UnsupportedReason.BAD_VALUE, "config.json: sizes must be positive")
        return shape

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape | None:
        """None when the config is outside the model (see :meth:`read` for the reason)."""
        return shape if isinstance(shape := cls.read(config), ModelShape) else None

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def sizes(self) -> dict[str, Any]:
        """The eight sizes alone: the per-host peak store's key, as it was before the facts existed."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)[:8]}

    @property
    def block(self) -> Block | None:
        """The modelled block of this model type (None: not modelled)."""
        return BLOCKS.get(self.model_type)

    def missing_terms(self) -> tuple[str, ...]:
        """The memory terms an unmodelled model would need (empty for a modelled block)."""
        if self.block is not None:
            return ()
        eager = "eager attention scores (micro x heads x seq^2 per layer: scores, tanh, fp32 softmax)"
        terms = [eager] if self.attn_implementation == "eager" else []
        if self.final_softcap:
            terms.append("softcapped logits (inside trl's fused-head tiles: to measure)")
        if self.vocab >= LARGE_VOCAB:
            terms.append(f"{self.vocab}-token logits in fp32 (fused-head slices, eval) at that vocabulary")
        if self.experts:
            router = "router logits kept for the auxiliary loss" if self.router_logits else "routing buffers"
            terms += [f"{self.experts} resident experts per layer, unquantized and cast to fp32", router]
        if (block := FAMILIES.get(self.model_type)) is not None and block.attention != ATTENTION_MODULES:
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
            window = f"sliding window {self.sliding_window} on {self.sliding_layers} of {self.layers} layers"
            parts.append(window)
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
        """``{module: (in_features, out_features)}`` of one block's Linear layers (quantized, and
        what LoRA can adapt); a MoE block's experts and router are bare parameters."""
        h, i = self.hidden, self.intermediate
        block = self.block or Block()
        if block.fused:
            attention = {"qkv_proj": (h, self.q_dim + 2 * self.kv_dim), "o_proj": (self.q_dim, h)}
            return {**attention, "gate_up_proj": (h, 2 * i), "down_proj": (i, h)}
        q, kv = self.q_dim, self.kv_dim
        attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if block.moe:
            return attention
        return {**attention, "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def adapted(self, targets: Targets) -> tuple[str, ...]:
        """The block's Linear layers a LoRA ``target_modules`` value adapts on this model."""
        return resolve_targets(targets, self.model_type)

    @property
    def layer_params(self) -> int:
        """Parameters of the Linear layers of one block (the part that is quantized)."""
        return sum(a * b for a, b in self.linear_dims().values())

    @property
    def expert_params(self) -> int:
        """One block's unquantized MoE parameters: every expert's gate, up and down, the router."""
        return self.experts * (3 * self.hidden * self.expert_intermediate + self.hidden)

    @property
    def bias_params(self) -> int:
        """One block's q/k/v biases (Qwen2's): 16-bit in the checkpoint, fp32 once prepared."""
        return self.q_dim + 2 * self.kv_dim if self.qkv_bias else 0

    @property
    def active_expert_params(self) -> int:
        """The expert parameters one token runs through in a block (top-k of them)."""
        return self.experts_per_token * 3 * self.hidden * self.expert_intermediate if self.experts else 0

    @property
    def norm_params(self) -> int:
        """Every RMSNorm weight: the blocks' hidden-wide ones, the final one, the q/k norms."""
        block = self.block or Block()
        per_head, full = 2 * self.dim_per_head, self.q_dim + self.kv_dim
        head = {HeadNorm.NONE: 0, HeadNorm.PER_HEAD: per_head, HeadNorm.FULL: full}[block.head_norm]
        return (block.norms * self.layers + 1) * self.hidden + self.layers * head

    @property
    def params(self) -> int:
        """The blocks' Linear layers, the embeddings and the LM head (one matrix when tied), and what
        bitsandbytes leaves 16-bit and peft's prepare casts to fp32: norms, biases, MoE experts."""
        embeddings = self.vocab * self.hidden * (1 if self.tie_word_embeddings else 2)
        unquantized = self.norm_params + self.layers * (self.bias_params + self.expert_params)
        return self.layers * self.layer_params + embeddings + unquantized


def _not_modelled(what: str, config: Mapping[str, Any]) -> Unsupported:
    """The refusal of an unmodelled architecture, with its facts and lacking terms where known."""
    facts = ModelShape.architecture(config)
    covers = f"is not a block the memory model covers (model types: {', '.join(sorted(BLOCKS))})"
    if not isinstance(facts, ModelShape):
        why = f"{facts.detail}, so its attention, MLP and head are not read and no term would be right"
        return Unsupported(UnsupportedReason.NOT_MODELLED, f"{what} {covers}; {why}")
    terms = "; ".join(facts.missing_terms()) or "none known to differ, but the block is unmeasured"
    detail = f"{what} ({facts.describe()}) {covers}; it would need terms for: {terms}"
    return Unsupported(UnsupportedReason.NOT_MODELLED, detail, shape=facts)


def resolve_targets(targets: Targets, model_type: str = "llama") -> tuple[str, ...]:
    """The block's Linear layers a LoRA ``target_modules`` value adapts on a ``model_type`` model:
    a keyword by the family's table, any other string (a regex) as a list of names."""
    family_type = model_type if model_type in FAMILIES else "llama"
    known = FAMILIES[family_type]
    if isinstance(targets, str) and targets in KEYWORDS:
        # "mlp" on a family without one is refused at validate (contract.targets): nothing to adapt here.
        return () if targets == "mlp" and not known.mlp else tuple(resolve(targets, family_type))
    if isinstance(targets, str):
        return tuple(name for name in known.linear if name in targets)
    return tuple(name for name in targets if name in known.linear)
