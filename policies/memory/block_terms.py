"""The parts of one decoder block's saved activations that differ by family: attention and the MLP.

Counted on the CPU, byte for byte, with saved-tensor hooks over the child's own QLoRA build at
each family's released widths (bench/models/family_memory_cpu.py; bench/results/family-memory-cpu-2026-12-02/
has every tensor). Where a CUDA card saves differently the term is the card's: the dropout mask
of a LoRA adapter is 1 byte on CUDA (aten's ``native_dropout``), 2 on the CPU; the fp32
log-sum-exp SDPA keeps (4 bytes per head) is left out, as it was in the Llama terms the H200
grid checked. Per token, in the model's widths (h, i, q = heads x head_dim, kv, s):

* **SDPA** keeps q, k, v and the output in the autocast dtype, with k and v at the kv width while
  PyTorch runs grouped-query attention natively: only without a mask. A sliding window shorter
  than the sequence needs a mask; then k and v are repeated to every query head, and aten turns
  the bool mask into an additive one in the autocast dtype, which SDPA's node saves: ``2s`` per
  token, a storage of its own in every sliding layer (Gemma 3: 5 layers in 6; Mistral v0.1 and
  Phi-3: every layer). Below the window a sliding layer is a full one.
* **Eager** (Gemma 2, for its softcapping): q, and k and v repeated to every head, and per head a
  row of ``s`` scores three times: the tanh output of the softcap, the fp32 softmax, and its
  autocast-dtype copy the second matmul keeps (``8 H s``). A window is only a mask there.
* **The MLP**: gate, act(gate) and up in fp32 (Phi-3's gate_up output is one storage of the same
  bytes). A MoE block keeps that per routed token at the expert's width, plus the expert's fp32
  output and the routing indices and weights, and per token the router's fp32 softmax.
* **With checkpointing** every block's recompute is handed the masks, held for the whole step:
  Gemma 2's two fp32 additive masks ``[b, 1, s, s]`` (sliding and full), Gemma 3's bool one once
  the sequence reaches its window.
"""

from __future__ import annotations

from qlora_supervise.policies.memory.optimizer import FP32
from qlora_supervise.policies.memory.shape import ModelShape

#: MoE, per routed token: the expert's fp32 output (down_proj's), and the int64 indices and the
#: routing weight that route it (three index tensors, a 16-bit weight, the top-k normalisation).
ROUTED_TOKEN_H = FP32
ROUTED_TOKEN_FIXED = 38
#: MoE, per token and expert: the router's fp32 softmax; with the auxiliary loss on
#: (``output_router_logits``) its own softmax over the kept logits too (fp32 under CUDA autocast).
ROUTER_PER_EXPERT = FP32
AUX_LOSS_PER_EXPERT = FP32


def mlp_activation_bytes(shape: ModelShape) -> int:
    """What the MLP keeps per token (see the module docstring)."""
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
    layer's (False), or the average over the model's layers (None: what the layers keep together
    divided by their number)."""
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
    """The masks held for the step with checkpointing (see the module docstring)."""
    if shape.attn_implementation == "eager":
        kinds = 2 if 0 < shape.sliding_layers < shape.layers else 1
        return kinds * FP32 * batch * seq * seq
    return batch * seq * seq if masked(shape, seq) else 0
