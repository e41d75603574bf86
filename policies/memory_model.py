"""A coarse peak-memory model for a QLoRA attempt, calibrated by observed peaks.

It answers one question for the policy: "can this candidate config possibly fit the budget?"
so that the ladder skips rungs whose result would fail the same way. The terms follow the
accounting of the seed article (weights, trainable parameters, gradients, optimizer state,
activations); the per-layer activation size uses the estimate of Korthikanti et al., 2022
("Reducing Activation Recomputation in Large Transformer Models"): ``s*b*h*(34 + 5*a*s/h)``
bytes per layer in 16-bit without recomputation, of which the ``5*a*s/h`` part is the
attention-score matrix that fused attention (SDPA / flash, the default in transformers 5)
never materialises, so it is left out; ``2*s*b*h`` per layer (the saved layer input) with
full recomputation. Against a 7B QLoRA step at seq 2048 on the H200 (../shared/gpu and
bench/gpu_ladder.py): micro-batch 4 without checkpointing 40.0 GiB predicted, 40.7 measured;
with checkpointing 9.1 predicted, 11.1 measured; micro-batch 1 with checkpointing 5.0
predicted, 5.2 measured. Logits are counted apart because with a large vocabulary
they dominate small models: bf16 logits, their fp32 upcast for the loss, and its gradient.

:func:`calibrate` fits one scale factor from what the child actually reported. Until then the
raw estimate is trusted only when it exceeds the budget by a clear margin (25 %).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from qlora_supervise.trainer_child.protocol import Knobs

_OPTIMIZER_STATE_BYTES = {  # per trainable parameter
    "paged_adamw_8bit": 2,
    "adamw_8bit": 2,
    "paged_adamw_32bit": 8,
    "adamw_torch": 8,
    "adamw_torch_fused": 8,
}


@dataclass(frozen=True)
class ModelShape:
    """What the memory model needs from a model's ``config.json``."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> ModelShape | None:
        """None when the config lacks the Llama-style fields (then the model cannot be used)."""
        try:
            hidden = int(config["hidden_size"])
            heads = int(config["num_attention_heads"])
            return cls(
                hidden=hidden,
                layers=int(config["num_hidden_layers"]),
                heads=heads,
                kv_heads=int(config.get("num_key_value_heads") or heads),
                intermediate=int(config.get("intermediate_size") or 4 * hidden),
                vocab=int(config["vocab_size"]),
            )
        except (KeyError, TypeError, ValueError):
            return None

    @property
    def layer_params(self) -> int:
        head_dim = self.hidden // self.heads
        attention = 2 * self.hidden * self.hidden + 2 * self.hidden * self.kv_heads * head_dim
        return attention + 3 * self.hidden * self.intermediate


def estimate_peak(shape: ModelShape, knobs: Knobs) -> int:
    """Predicted peak bytes of training with ``knobs`` (uncalibrated)."""
    return _weights(shape, knobs) + _trainable(shape, knobs) + _activations(shape, knobs)


def _weights(shape: ModelShape, knobs: Knobs) -> int:
    bytes_per_param = 0.5 if knobs.load_in_4bit else 2.0
    # Embeddings and lm_head stay in 16-bit under bitsandbytes 4-bit loading.
    return int(shape.layers * shape.layer_params * bytes_per_param) + 2 * shape.vocab * shape.hidden * 2


def _trainable(shape: ModelShape, knobs: Knobs) -> int:
    head_dim = shape.hidden // shape.heads
    kv = shape.kv_heads * head_dim
    # q, k, v, o adapters: r * (in + out) each.
    per_layer = knobs.lora_r * ((2 * shape.hidden) * 2 + (shape.hidden + kv) * 2)
    params = shape.layers * per_layer
    state = _OPTIMIZER_STATE_BYTES.get(knobs.optimizer, 8)
    return params * (4 + 4 + state)  # fp32 weights + fp32 grads + optimizer state


def _activations(shape: ModelShape, knobs: Knobs) -> int:
    s, b, h = knobs.max_seq_len, knobs.micro_batch_size, shape.hidden
    full_layer = 34 * s * b * h
    if knobs.gradient_checkpointing:
        layers = shape.layers * 2 * s * b * h + full_layer  # saved inputs + one layer recomputed
    else:
        layers = shape.layers * full_layer
    logits = s * b * shape.vocab * (2 + 4 + 4)
    return int(layers + logits)


@dataclass(frozen=True)
class Observation:
    """A peak the child reported (or the bytes an OOM needed) for the knobs it ran with."""

    knobs: Knobs
    peak_bytes: int
    exceeded: bool = False  # True: the attempt died needing *at least* this much


def calibrate(shape: ModelShape, observations: Sequence[Observation]) -> float | None:
    """One scale factor, observed / predicted, from completed peaks; None without data.

    Only non-exceeded observations calibrate: an OOM tells a lower bound, not the peak.
    The median keeps one odd attempt from steering the model.
    """
    ratios = sorted(
        o.peak_bytes / estimate_peak(shape, o.knobs) for o in observations if not o.exceeded and o.peak_bytes
    )
    if not ratios:
        return None
    return ratios[len(ratios) // 2]


UNCALIBRATED_MARGIN = 1.25


def cannot_fit(shape: ModelShape, knobs: Knobs, budget: int, scale: float | None) -> bool:
    """True when the calibrated prediction exceeds the budget, or the raw one exceeds it by 25 %."""
    if scale is None:
        return estimate_peak(shape, knobs) > budget * UNCALIBRATED_MARGIN
    return estimate_peak(shape, knobs) * scale > budget
