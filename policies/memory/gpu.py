"""Peak GPU memory of one QLoRA training attempt of our recipe, term by term, in bytes.
docs/planning.md says what each term counts in the recipe and the libraries (trl 1.16, peft 0.21,
torch 2.11, bitsandbytes 0.50). Coefficients that are not exact byte counts are named constants,
checked against bench/results/memory-grid-h200-2026-12-01/ (``bench/models/score_memory_grid.py``).
The family terms of a block (:func:`attention_bytes`, :func:`mlp_activation_bytes`) were counted
with saved-tensor hooks at each family's released widths (bench/results/family-memory-cpu-*/), on
CUDA's footing (a LoRA dropout mask is 1 byte; the fp32 log-sum-exp SDPA keeps is left out)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from qlora_supervise.policies.memory.families import Block, HeadNorm
from qlora_supervise.policies.memory.shape import ModelShape, Targets
from qlora_supervise.trainer_child.contract.spec import Knobs

#: The recipe's LoRA targets: the attention projections, by each family's own names.
DEFAULT_TARGETS: Targets = "attention"
#: Bytes per quantized weight: packed 4-bit codes plus the per-block absmax (blocksize 64).
NF4_DOUBLE_QUANT = 0.5 + 1 / 64 + 4 / (64 * 256)
NF4_SINGLE_QUANT = 0.5 + 4 / 64
FP32 = 4  # fp32: what prepare_model_for_kbit_training leaves every non-quantized parameter in.
#: The checkpoint's 16-bit dtype, the one each parameter is cast from at load (and FSDP's storage).
LOAD_DTYPE = 2
HEAD_TOKEN_TILE = 4096  # trl's fused LM head tiles (trl/kernels/chunked_logprob.py).
HEAD_VOCAB_TILE = 32768
#: Outside the allocator: the CUDA context, cuBLAS handles and kernels (H200, torch 2.11).
CUDA_CONTEXT = 600 << 20
#: A 32 MiB cuBLAS workspace (torch's default on Hopper) for each of training's two threads, the
#: forward's and autograd's: the ~0.06 GiB every small point of the H200 grids was short by.
BLAS_WORKSPACES = 2 * (32 << 20)
#: Reserved over allocated at the peak; the caching allocator rounds and keeps split blocks.
RESERVE_FRACTION = 0.08
RESERVE_FRACTION_EXPANDABLE = 0.02
GATHERED_BLOCKS = 2  # FSDP: blocks gathered at once, the one running and the one backward prefetch brings in.


@dataclass(frozen=True)
class Prediction:
    """A predicted peak by component (bytes): ``peak_bytes`` is the peak PyTorch *allocated* (what
    ``gpu_memory_limit`` caps), the sum of ``components``; ``outside`` is on the card outside the
    allocator (CUDA context, paged optimizer state); ``card_bytes`` is what the card must hold.
    ``phase``: load, backward, backward_end, optimizer_step or eval."""

    components: Mapping[str, int]
    peak_bytes: int
    reserved_bytes: int
    outside: Mapping[str, int] = field(default_factory=dict)
    phase: str = "backward"

    @property
    def card_bytes(self) -> int:
        return self.reserved_bytes + sum(self.outside.values())


# ---- the LoRA adapter's own bytes, per tensor: its weights, their gradients, the optimizer's state.
# trl casts a quantized model's adapter to bf16 (unquantized, peft's fp32 stays); torch AdamW keeps
# two moments in the adapter's dtype plus a foreach step temporary (none fused); bitsandbytes keeps
# two fp32 moments, or uint8 ones with an fp32 absmax per 256 for tensors of ``min_8bit_size`` or more,
# and a paged optimizer pages only tensors of 1e5 elements or more (smaller ones are ordinary allocations).
ADAPTER_BYTES_QUANTIZED = 2  # trl's bf16 for a quantized model's trainable parameters
#: bitsandbytes: tensors under this many elements keep fp32 state in the 8-bit optimizers.
BNB_MIN_8BIT_SIZE = 4096
#: bitsandbytes: a paged optimizer pages a state tensor only from this many elements on.
BNB_PAGED_MIN_NUMEL = 100_000
#: bitsandbytes 8-bit blockwise state: one fp32 absmax per block of 256, for each of two moments.
BNB_8BIT_BLOCK = 256
#: transformers' names of bitsandbytes' 8-bit AdamW (``adamw_bnb_8bit``: axolotl's, LLaMA-Factory's).
BNB_8BIT = frozenset({"adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit"})
BNB_32BIT = frozenset({"paged_adamw_32bit"})


@dataclass(frozen=True)
class AdapterBytes:
    """The adapter's bytes on the card by where they live, for one config."""

    params: int
    grads: int
    state: int  # optimizer state inside PyTorch's allocator
    paged: int  # optimizer state in CUDA unified memory (outside the allocator)
    step_temp: int  # what the optimizer step allocates on top, for the step's duration


def adapter_dtype_bytes(knobs: Knobs) -> int:
    """Bytes per adapter parameter (and gradient): bf16 on the 4-bit path, fp32 otherwise."""
    return ADAPTER_BYTES_QUANTIZED if knobs.load_in_4bit else FP32


def adapter_tensors(shape: ModelShape, r: int, targets: Targets) -> list[int]:
    """The element count of every LoRA weight tensor (lora_A is r x in, lora_B is out x r)."""
    dims = shape.linear_dims()
    per_layer = [n for name in shape.adapted(targets) for n in (r * dims[name][0], dims[name][1] * r)]
    return per_layer * shape.layers


def adapter_bytes(shape: ModelShape, knobs: Knobs, targets: Targets) -> AdapterBytes:
    """Weights, gradients and optimizer state of the adapter ``knobs`` and ``targets`` describe; an
    optimizer outside those modelled counts as torch AdamW, the largest of them."""
    tensors = adapter_tensors(shape, knobs.lora_r, targets)
    n, size, name = sum(tensors), adapter_dtype_bytes(knobs), knobs.optimizer
    state = paged = temp = 0
    if name in BNB_8BIT or name in BNB_32BIT:
        for numel in tensors:  # bitsandbytes' two moments of each tensor
            eight = name in BNB_8BIT and numel >= BNB_MIN_8BIT_SIZE
            moments = 2 * numel + 2 * FP32 * -(-numel // BNB_8BIT_BLOCK) if eight else 2 * FP32 * numel
            if name.startswith("paged_") and numel >= BNB_PAGED_MIN_NUMEL:
                paged += moments
            else:
                state += moments
    else:
        state = 2 * size * n
        temp = 0 if name == "adamw_torch_fused" else size * n
    return AdapterBytes(params=size * n, grads=size * n, state=state, paged=paged, step_temp=temp)


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
    # A sliding window shorter than the sequence needs a mask: k and v are repeated to every head.
    slide = full + 2 * half * (shape.q_dim - shape.kv_dim) + half * seq
    if sliding is not None:
        return slide if sliding else full
    return (slide * shape.sliding_layers + full * (shape.layers - shape.sliding_layers)) // shape.layers


def checkpoint_masks(shape: ModelShape, batch: int, seq: int) -> int:
    """The masks every block's recompute is handed with checkpointing, held for the step: Gemma 2's
    two fp32 additive masks, the bool one of a sliding window the sequence reaches."""
    if shape.attn_implementation == "eager":
        return (2 if 0 < shape.sliding_layers < shape.layers else 1) * FP32 * batch * seq * seq
    return batch * seq * seq if masked(shape, seq) else 0


def lora_params(shape: ModelShape, r: int, targets: Targets) -> int:
    return sum(adapter_tensors(shape, r, targets))


def per_weight(knobs: Knobs) -> float:
    """Bytes per weight of the block's linear layers as loaded (before any fp32 upcast)."""
    quantized = NF4_DOUBLE_QUANT if knobs.double_quant else NF4_SINGLE_QUANT
    return quantized if knobs.load_in_4bit else LOAD_DTYPE


def base_components(shape: ModelShape, knobs: Knobs) -> dict[str, int]:
    """The base model as peft's prepare_model_for_kbit_training casts it; under FSDP a rank's share."""
    if knobs.fsdp:
        # One rank's shard of every block, the gathered blocks, the root. LoRA and the optimizer
        # state stay counted whole (a small over-estimate, unmeasured on cards).
        block = fsdp_block_bytes(shape, per_weight(knobs))
        return {
            "weights_4bit_shard": shape.layers * block // max(knobs.world_size, 1),
            "gathered_blocks": min(GATHERED_BLOCKS, shape.layers) * block,
            **_root(shape),
        }
    quantized = shape.layers * shape.layer_params
    # Without 4-bit, prepare_model_for_kbit_training upcasts the 16-bit weights to fp32 too.
    weights = int(quantized * per_weight(knobs)) if knobs.load_in_4bit else quantized * FP32
    # bf16_head: the embeddings and the untied head stay 16-bit (the norms stay fp32).
    size, dtype = (LOAD_DTYPE, "bf16") if knobs.bf16_head else (FP32, "fp32")
    return {
        "weights_4bit" if knobs.load_in_4bit else "weights_fp32": weights,
        f"embeddings_{dtype}": shape.vocab * shape.hidden * size,
        f"lm_head_{dtype}": 0 if shape.tie_word_embeddings else shape.vocab * shape.hidden * size,
        "norms_fp32": shape.norm_params * FP32,
        # Bare parameters bitsandbytes does not quantize, which peft's prepare casts to fp32.
        "experts_fp32": shape.layers * shape.expert_params * FP32,
        "biases_fp32": shape.layers * shape.bias_params * FP32,
    }


def fsdp_block_bytes(shape: ModelShape, per_weight: float) -> int:
    """One decoder block as FSDP holds it: 4-bit linear layers, 16-bit experts, biases and norms
    (the codes are stored in the compute dtype, so nothing is upcast)."""
    unquantized = shape.expert_params + shape.bias_params + shape.norm_params // max(shape.layers, 1)
    return int(shape.layer_params * per_weight) + unquantized * LOAD_DTYPE


def _root(shape: ModelShape) -> dict[str, int]:
    """FSDP's root unit, gathered whole on every rank: the 16-bit embeddings and head."""
    head = 0 if shape.tie_word_embeddings else shape.vocab * shape.hidden * LOAD_DTYPE
    return {"embeddings_bf16": shape.vocab * shape.hidden * LOAD_DTYPE, "lm_head_bf16": head}


def static_components(shape: ModelShape, knobs: Knobs, targets: Targets = DEFAULT_TARGETS) -> dict[str, int]:
    """What sits on the card once the model is loaded and the adapter attached (in trl's dtype)."""
    adapter = lora_params(shape, knobs.lora_r, targets) * adapter_dtype_bytes(knobs)
    return {**base_components(shape, knobs), "lora_params": adapter}


def load_components(shape: ModelShape, knobs: Knobs, targets: Targets = DEFAULT_TARGETS) -> dict[str, int]:
    """The larger of the two load moments: the fp32 cast of the largest 16-bit parameter (its bf16
    original and fp32 copy coexist), and the adapter in peft's fp32 before trl casts it to bf16."""
    base = base_components(shape, knobs)
    if knobs.fsdp:  # bitsandbytes quantizes on the card: every rank holds the whole 4-bit model
        base = {"weights_4bit": shape.layers * fsdp_block_bytes(shape, per_weight(knobs)), **_root(shape)}
    # With bf16_head the embeddings and head are not cast: the largest cast is a norm's weight.
    largest = shape.hidden if knobs.bf16_head else shape.vocab * shape.hidden
    if shape.experts:  # one fused 3D parameter: every expert's gate and up of one block
        largest = max(largest, shape.experts * 2 * shape.expert_intermediate * shape.hidden)
    if not knobs.load_in_4bit:
        largest = max(largest, *(a * b for a, b in shape.linear_dims().values()))
    cast = 0 if knobs.fsdp else largest * LOAD_DTYPE
    adapter_fp32 = lora_params(shape, knobs.lora_r, targets) * FP32
    return {**base, **({"load_cast_16bit": cast} if cast >= adapter_fp32 else {"lora_params": adapter_fp32})}


def layer_activation_bytes(shape: ModelShape, r: int, targets: Targets, half: int = 2, seq: int = 0) -> int:
    """Bytes autograd keeps per token for one decoder block (no checkpointing), at ``seq`` tokens a
    sequence (only eager attention depends on it); ``half``: the autocast dtype's size. Layer 0 keeps
    a little less (its input needs no gradient), which the model leaves in as margin."""
    block = shape.block or Block()
    norms = block.norms * FP32 * shape.hidden
    head_norms = FP32 * (shape.q_dim + shape.kv_dim) if block.head_norm is not HeadNorm.NONE else 0
    dims = shape.linear_dims()
    # Per adapter: its dropout mask (1 byte) and lora_A's 16-bit input per input feature, and
    # lora_A's output (r wide) for lora_B.
    adapters = sum((1 + half) * dims[n][0] + half * r for n in shape.adapted(targets))
    return norms + head_norms + mlp_activation_bytes(shape) + attention_bytes(shape, half, seq) + adapters


#: Eager attention's backward, per token, head and key position: the scores' gradient (autocast
#: dtype), its fp32 cast for the softmax's backward, and that backward's fp32 output. Unmeasured.
EAGER_BACKWARD_SCORES = 2 + FP32 + FP32
#: The backward of one block, per token: two fp32 i-wide gradients (gate's and up's) and two fp32
#: h-wide ones (the residual's and the block output's).
BACKWARD_TRANSIENT_I = 8
BACKWARD_TRANSIENT_H = 8
#: A MoE block's backward, per routed token: two fp32 h-wide gradients, the expert output's and
#: its gathered input's (H200, Qwen3-MoE, top-8: 132 KB a token = 8 x 8 h).
MOE_BACKWARD_ROUTED_H = 8


def block_backward_bytes(
    shape: ModelShape, knobs: Knobs, targets: Targets = DEFAULT_TARGETS, half: int = 2
) -> int:
    """One block's backward on top of what stays kept: with checkpointing its recomputed
    activations, then its fp32 gradients and one weight bitsandbytes dequantizes to 16-bit."""
    tokens, seq = knobs.micro_batch_size * knobs.max_seq_len, knobs.max_seq_len
    ckpt = knobs.gradient_checkpointing
    recomputed = layer_activation_bytes(shape, knobs.lora_r, targets, half, seq) if ckpt else 0
    widest = max(a * b for a, b in shape.linear_dims().values())
    if shape.experts:
        routed = BACKWARD_TRANSIENT_I * shape.expert_intermediate + MOE_BACKWARD_ROUTED_H * shape.hidden
        mlp = shape.experts_per_token * routed
    else:
        mlp = BACKWARD_TRANSIENT_I * shape.intermediate
    per_token = recomputed + mlp + BACKWARD_TRANSIENT_H * shape.hidden
    if shape.attn_implementation == "eager":
        per_token += EAGER_BACKWARD_SCORES * shape.heads * seq
    return tokens * per_token + widest * half


def activation_components(
    shape: ModelShape, knobs: Knobs, targets: Targets = DEFAULT_TARGETS, half: int = 2
) -> dict[str, int]:
    """What the forward keeps plus the larger of the backward's two first moments: the LM head
    (:func:`loss_components`) and the last block (:func:`block_backward_bytes`)."""
    tokens = knobs.micro_batch_size * knobs.max_seq_len
    per_layer = layer_activation_bytes(shape, knobs.lora_r, targets, half, knobs.max_seq_len)
    final_norm = FP32 * shape.hidden * tokens
    per_kept_layer = FP32 * shape.hidden if knobs.gradient_checkpointing else per_layer
    # activation_offload: what autograd saves is in host memory; one block's comes back at a time.
    on_card = 1 if knobs.activation_offload else shape.layers
    kept = on_card * per_kept_layer * tokens + final_norm
    if knobs.gradient_checkpointing:  # the masks every block's recompute is handed, held once
        kept += checkpoint_masks(shape, knobs.micro_batch_size, knobs.max_seq_len)
    block = block_backward_bytes(shape, knobs, targets, half)
    head = loss_components(shape, knobs.micro_batch_size, knobs.max_seq_len, half, knobs.bf16_head)
    return {"activations": kept, **(head if sum(head.values()) >= block else {"backward_block": block})}


def loss_components(
    shape: ModelShape, batch: int, seq: int, half: int = 2, bf16_head: bool = False
) -> dict[str, int]:
    """trl's fused LM head in its backward: kept fp32 hidden states, their fp32 gradient, and the
    tiles: the bf16 logits buffer (a token tile by a vocabulary slice), the bf16 copy of the token
    tile, a bf16 slice of the head, two while the loop moves to the next slice (none when the head
    is bf16 already: ``.to(bf16)`` is a no-op)."""
    scored = batch * max(seq - 1, 1)  # every position with a next-token label
    tile_tokens = min(scored, HEAD_TOKEN_TILE)
    tile_vocab = min(shape.vocab, HEAD_VOCAB_TILE)
    slices = 0 if bf16_head else (2 if shape.vocab > HEAD_VOCAB_TILE else 1)
    tiles = (tile_tokens * (tile_vocab + shape.hidden) + slices * tile_vocab * shape.hidden) * half
    return {"loss_hidden_fp32": scored * shape.hidden * FP32 * 2, "loss_tiles": tiles}


def eval_components(shape: ModelShape, knobs: Knobs, half: int = 2) -> dict[str, int]:
    """An evaluation batch under no_grad: one block's intermediates at a time, and the head."""
    tokens = knobs.eval_batch_size * knobs.max_seq_len
    block = 4 * FP32 * shape.intermediate + 3 * FP32 * shape.hidden
    if shape.attn_implementation == "eager":  # one layer's scores and their fp32 softmax at a time
        block += shape.heads * knobs.max_seq_len * (half + FP32)
    loss = loss_components(shape, knobs.eval_batch_size, knobs.max_seq_len, half, knobs.bf16_head)
    return {"eval_activations": tokens * block, "loss_tiles": loss["loss_tiles"]}


def training_phases(
    shape: ModelShape, knobs: Knobs, targets: Targets, half: int
) -> dict[str, dict[str, int]]:
    """Each moment that can hold the peak, by component: load, backward (the gradients only from
    the second micro-batch of an accumulation: the Trainer sets them to None after each step),
    backward_end (the first block's backward with every gradient made), optimizer_step, eval."""
    static = {**static_components(shape, knobs, targets), "blas_workspaces": BLAS_WORKSPACES}
    adapter = adapter_bytes(shape, knobs, targets)
    state, grads = {"optimizer_state": adapter.state}, {"lora_grads": adapter.grads}
    tokens = knobs.micro_batch_size * knobs.max_seq_len
    first_block = block_backward_bytes(shape, knobs, targets, half)
    if not knobs.gradient_checkpointing:  # the first block's own kept activations are still there
        first_block += layer_activation_bytes(shape, knobs.lora_r, targets, half, knobs.max_seq_len) * tokens
    activations = activation_components(shape, knobs, targets, half)
    phases: dict[str, dict[str, int]] = {
        "load": load_components(shape, knobs, targets),
        "backward": {**static, **state, **(grads if knobs.grad_accum > 1 else {}), **activations},
        "backward_end": {**static, **state, **grads, "backward_block": first_block},
        "optimizer_step": {**static, **state, **grads, "optimizer_step_temp": adapter.step_temp},
    }
    if knobs.eval_enabled:
        phases["eval"] = {**static, **state, **eval_components(shape, knobs, half)}
    return phases


def predict(shape: ModelShape, knobs: Knobs, targets: Targets = DEFAULT_TARGETS, half: int = 2) -> Prediction:
    """The largest phase of :func:`training_phases`, with the allocator's reserve and what sits outside it."""
    phases = training_phases(shape, knobs, targets, half)
    phase, components = max(phases.items(), key=lambda item: sum(item[1].values()))
    peak = sum(components.values())
    fraction = RESERVE_FRACTION_EXPANDABLE if knobs.expandable_segments else RESERVE_FRACTION
    outside = {"cuda_context": CUDA_CONTEXT}
    if paged := adapter_bytes(shape, knobs, targets).paged:
        outside["paged_optimizer_state"] = paged
    kept = {k: v for k, v in components.items() if v}
    return Prediction(kept, peak, int(peak * (1 + fraction)), outside, phase)
