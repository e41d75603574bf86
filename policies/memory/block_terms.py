"""What one decoder block saves for backward where families differ: attention and the MLP.

Counted byte for byte with saved-tensor hooks over the child's QLoRA build at each family's released
widths (bench/results/family-memory-cpu-2026-12-02/), on CUDA's footing (a LoRA dropout mask is 1
byte; the fp32 log-sum-exp SDPA keeps is left out). SDPA keeps q, k, v and the output, k and v at
the kv width unless a sliding window shorter than the sequence needs a mask: then they are repeated
to every head and the additive mask (``2s`` a token) is kept in each sliding layer. Eager attention
(Gemma 2's softcapping) keeps per head ``s`` scores three times. See docs/planning.md.
"""

from __future__ import annotations

from qlora_supervise.policies.memory.optimizer import FP32
from qlora_supervise.policies.memory.shape import ModelShape

#: MoE, per routed token: the expert's fp32 output, and its int64 indices and routing weight.
ROUTED_TOKEN_H = FP32
ROUTED_TOKEN_FIXED = 38
#: MoE, per token and expert: the router's fp32 softmax, and the auxiliary loss's own softmax.
ROUTER_PER_EXPERT = FP32
AUX_LOSS_PER_EXPERT = FP32


def mlp_activation_bytes(shape: ModelShape) -> int:
    """What the MLP keeps per token: gate, act(gate) and up in fp32 (per routed token for MoE)."""
    if not shape.experts:
        return 3 * FP32 * shape.intermediate
    expert = 3 * FP32 * shape.expert_intermediate + ROUTED_TOKEN_H * shape.hidden + ROUTED_TOKEN_FIXED
    router = (ROUTER_PER_EXPERT + (AUX_LOSS_PER_EXPERT if shape.router_logits else 0)) * shape.experts
    return shape.experts_per_token * expert + router


def masked(shape: ModelShape, seq: int) -> bool:
    """Whether the sliding layers get a mask at this sequence length (SDPA; the window is shorter)."""
    return bool(shape.sliding_window and shape.sliding_layers and seq >= shape.sliding_window)


def attention_bytes(shape: ModelShape, half: int = 2, seq: int = 0, sliding: bool | None = None) -> int:
    """What attention keeps per token in one block: a sliding layer's (``sliding=True``), a full
    layer's (False), or the average over the model's layers (None)."""
    if shape.attn_implementation == "eager":
        scores = (half if shape.attn_softcap else 0) + FP32 + half
        return half * 3 * shape.q_dim + shape.heads * seq * scores
    full = half * (2 * shape.q_dim + 2 * shape.kv_dim)
    if not masked(shape, seq):
        return full
    # The mask, and k and v at the query width instead of the kv width.
    slide = full + 2 * half * (shape.q_dim - shape.kv_dim) + half * seq
    if sliding is not None:
        return slide if sliding else full
    return (slide * shape.sliding_layers + full * (shape.layers - shape.sliding_layers)) // shape.layers


def checkpoint_masks(shape: ModelShape, batch: int, seq: int) -> int:
    """The masks every block's recompute is handed with checkpointing, held for the step: Gemma 2's
    two fp32 additive masks, the bool one of a sliding window the sequence reaches."""
    if shape.attn_implementation == "eager":
        kinds = 2 if 0 < shape.sliding_layers < shape.layers else 1
        return kinds * FP32 * batch * seq * seq
    return batch * seq * seq if masked(shape, seq) else 0
