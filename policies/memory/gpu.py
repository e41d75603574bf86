"""Peak GPU memory of one QLoRA training attempt of our recipe, term by term, in bytes.

What the recipe does to memory (trainer_child/recipe.py, read against the installed libraries):

* **4-bit weights.** bitsandbytes NF4 stores two weights per byte, plus one absmax per block of
  64 weights: with double quantization that absmax is 8-bit, with one fp32 absmax per 256 blocks
  on top (``0.5 + 1/64 + 4/16384`` bytes per weight); without it, fp32 (``0.5 + 4/64``).
* **Everything not quantized is fp32.** peft's ``prepare_model_for_kbit_training`` casts every
  16-bit parameter that is not ``Params4bit`` to fp32 (peft/utils/other.py): the embeddings, the
  LM head (bitsandbytes never quantizes it), every RMSNorm weight. A 128k vocabulary at hidden
  4096 is therefore 2.1 GB per matrix, twice when untied. The cast is one parameter at a time
  (``param.data = param.data.to(float32)``), so while the largest one is cast its bf16 original
  and its fp32 copy coexist with everything else: the **load** peak, which is the whole peak of
  a short-sequence job on an untied 128k vocabulary (8B, seq 512, checkpointing: 8.25 GiB).
* **The adapter, its gradients and the optimizer state** are in :mod:`.optimizer`: bf16 adapter
  weights and gradients on the 4-bit path (trl casts them), state by optimizer kind and by tensor
  size (small tensors of a *paged* optimizer are not paged). Paged state sits in CUDA unified
  memory, outside PyTorch's allocator: on the card, not in ``max_memory_allocated``, so it is in
  ``outside`` (``paged_optimizer_state``), not in the allocated peak.
* **Activations.** Because the norms and embeddings are fp32, the residual stream and every norm
  output are fp32, and bitsandbytes' ``Linear4bit`` returns its output in its input's dtype, so
  q/k/v and the MLP's gate/up/down outputs are fp32 as well. Per token and layer, autograd keeps:
  the two norm inputs (fp32), the gated MLP's three intermediates (gate, SiLU(gate), up; fp32),
  SDPA's query, key, value and output (bf16 under autocast; key and value at the kv width:
  grouped-query attention is passed to SDPA natively when there is no padding mask), and per
  LoRA adapter its dropout mask (1 byte) and the 16-bit input of ``lora_A`` (2 bytes) per input
  feature. The 4-bit matmul saves only the packed weight. With gradient checkpointing
  (non-reentrant, per block) each block keeps only its fp32 input and one block's activations
  are recomputed at a time.
* **The loss.** trl 1.16's SFTTrainer patches a fused LM head (trl/trainer/utils.py,
  ``add_fused_lm_head``; trl/kernels/chunked_logprob.py): log-probabilities are folded tile by
  tile (4096 tokens x 32768 vocabulary entries, bf16), so the ``tokens x vocab`` logits are never
  materialised. It keeps the gathered fp32 hidden states for backward and builds an fp32
  gradient of the same size. Its backward loop binds ``w_chunk = weight[start:end].to(bf16)``,
  so the next slice of the head is allocated while the previous one is still bound: two bf16
  slices of 32768 rows are live at once whenever the vocabulary has more than one slice.
* **Backward transients.** The backward of one block holds fp32 gradients of its widest
  intermediates (the MLP's product backward returns two i-wide fp32 gradients, gate's and up's,
  while the residual's and the block output's h-wide fp32 gradients are live), and bitsandbytes
  dequantizes a 4-bit weight to its 16-bit storage dtype for ``grad_input`` (the incoming
  gradient is already 16-bit, so the ``.to(grad_output.dtype)`` is a no-op: 2 bytes per weight).

* **The bf16 head** (``Knobs.bf16_head``): the embeddings and the untied LM head stay in bf16,
  half their fp32 bytes, and nothing of theirs is cast at load. **Activation offload**
  (``Knobs.activation_offload``, ``torch.autograd.graph.save_on_cpu``): what autograd saves sits
  in host memory; one block's share comes back to the card at a time in backward.

The coefficients that are not exact byte counts (the backward transients' 8 bytes per i and per
h, the allocator's reserve) are named constants below, checked against the H200 grid in
bench/results/memory-grid-h200-2026-12-01/ (``bench/models/score_memory_grid.py`` re-scores it);
calibration corrects the rest per run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from qlora_supervise.policies.memory.block_terms import (
    attention_bytes,
    checkpoint_masks,
    mlp_activation_bytes,
)
from qlora_supervise.policies.memory.families import Block, HeadNorm
from qlora_supervise.policies.memory.optimizer import (
    AdapterBytes,
    adapter_bytes,
    adapter_dtype_bytes,
    adapter_tensors,
)
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.policies.memory.sharding import loaded_components, sharded_components
from qlora_supervise.trainer_child.contract.spec import Knobs

GiB = 1 << 30
#: The recipe's LoRA targets: the attention projections, by each family's own names.
DEFAULT_TARGETS: tuple[str, ...] | str = "attention"

#: Bytes per quantized weight: packed 4-bit codes plus the per-block absmax (blocksize 64).
NF4_DOUBLE_QUANT = 0.5 + 1 / 64 + 4 / (64 * 256)
NF4_SINGLE_QUANT = 0.5 + 4 / 64
#: fp32: what prepare_model_for_kbit_training leaves every non-quantized parameter in.
FP32 = 4
#: The checkpoint's 16-bit dtype, the one each parameter is cast from at load.
LOAD_DTYPE = 2
#: The optimizers the job file accepts (supervisor/jobfile/fields.py ``Optimizer``).
OPTIMIZERS = ("adamw_torch", "adamw_torch_fused", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit")
#: trl's fused LM head tiles (trl/kernels/chunked_logprob.py).
HEAD_TOKEN_TILE = 4096
HEAD_VOCAB_TILE = 32768
#: Outside the allocator: the CUDA context, cuBLAS handles and kernels (H200, torch 2.11).
CUDA_CONTEXT = 600 << 20
#: Inside the allocator once the first matmul runs: a cuBLAS workspace per (handle, stream), and
#: training has two, the forward's thread and autograd's backward thread. 32 MiB each is torch's
#: default on Hopper (8 MiB before it; the larger is kept for every card). It is the ~0.06 GiB that
#: every small point of the H200 grids was short by (Llama 1B/7B, Qwen3, Gemma 3 at seq 512).
BLAS_WORKSPACES = 2 * (32 << 20)
#: Reserved over allocated at the peak; the caching allocator rounds and keeps split blocks.
RESERVE_FRACTION = 0.08
RESERVE_FRACTION_EXPANDABLE = 0.02


@dataclass(frozen=True)
class Prediction:
    """A predicted peak, by component (bytes).

    ``peak_bytes`` is the peak PyTorch *allocated* (``torch.cuda.max_memory_allocated``, what
    ``gpu_memory_limit`` caps); ``components`` sums to it. ``outside`` holds what is on the card
    but outside the allocator (CUDA context, paged optimizer state), and ``reserved_bytes`` is
    the allocator's peak reserve; ``card_bytes`` is what the card must hold. ``phase`` is where
    the peak happens: load, backward, backward_end, optimizer_step or eval.
    """

    components: Mapping[str, int]
    peak_bytes: int
    reserved_bytes: int
    outside: Mapping[str, int] = field(default_factory=dict)
    phase: str = "backward"

    @property
    def card_bytes(self) -> int:
        return self.reserved_bytes + sum(self.outside.values())


def lora_params(shape: ModelShape, r: int, targets: tuple[str, ...] | str) -> int:
    """How many parameters the adapter has."""
    return sum(adapter_tensors(shape, r, targets))


def base_components(shape: ModelShape, knobs: Knobs) -> dict[str, int]:
    """The base model once prepare_model_for_kbit_training has cast it: 4-bit layers, fp32 rest;
    under FSDP one rank's share of it (:mod:`.sharding`: nothing upcast, blocks sharded)."""
    quantized = shape.layers * shape.layer_params
    per_weight = NF4_DOUBLE_QUANT if knobs.double_quant else NF4_SINGLE_QUANT
    if knobs.fsdp:
        return sharded_components(shape, knobs, per_weight if knobs.load_in_4bit else LOAD_DTYPE)
    # Without 4-bit, prepare_model_for_kbit_training upcasts the 16-bit weights to fp32 too.
    weights = int(quantized * per_weight) if knobs.load_in_4bit else quantized * FP32
    # bf16_head: the recipe leaves the embeddings and the untied head in the checkpoint's 16-bit
    # dtype instead of letting prepare_model_for_kbit_training upcast them (the norms stay fp32).
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


def static_components(
    shape: ModelShape, knobs: Knobs, targets: tuple[str, ...] | str = DEFAULT_TARGETS
) -> dict[str, int]:
    """What sits on the card once the model is loaded and the adapter attached (in trl's dtype)."""
    return {
        **base_components(shape, knobs),
        "lora_params": lora_params(shape, knobs.lora_r, targets) * adapter_dtype_bytes(knobs),
    }


def load_components(
    shape: ModelShape, knobs: Knobs, targets: tuple[str, ...] | str = DEFAULT_TARGETS
) -> dict[str, int]:
    """The larger of the two load moments: the fp32 cast of the largest 16-bit parameter, and the
    adapter in peft's fp32 before trl casts it to bf16 (one tensor at a time, so not both at once)."""
    base = base_components(shape, knobs)
    if knobs.fsdp:  # nothing is cast, but the load holds the whole model, unsharded (.sharding)
        per_weight = NF4_DOUBLE_QUANT if knobs.double_quant else NF4_SINGLE_QUANT
        base = loaded_components(shape, per_weight if knobs.load_in_4bit else LOAD_DTYPE)
    # With bf16_head the embeddings and head are not cast: the largest cast is a norm's weight.
    largest = shape.hidden if knobs.bf16_head else shape.vocab * shape.hidden
    if shape.experts:  # one fused 3D parameter: every expert's gate and up of one block
        largest = max(largest, shape.experts * 2 * shape.expert_intermediate * shape.hidden)
    if not knobs.load_in_4bit:
        largest = max(largest, *(a * b for a, b in shape.linear_dims().values()))
    cast = 0 if knobs.fsdp else largest * LOAD_DTYPE  # FSDP: nothing is upcast (.sharding)
    adapter_fp32 = lora_params(shape, knobs.lora_r, targets) * FP32
    if cast >= adapter_fp32:
        return {**base, "load_cast_16bit": cast}
    return {**base, "lora_params": adapter_fp32}


def layer_activation_bytes(
    shape: ModelShape, r: int, targets: tuple[str, ...] | str, half: int = 2, seq: int = 0
) -> int:
    """Bytes autograd keeps per token for one decoder block (no checkpointing), at ``seq`` tokens
    a sequence (only eager attention depends on it).

    ``half`` is the autocast dtype's size (2 for bf16/fp16, 4 when training in fp32 on the CPU).
    The family terms (:mod:`.block_terms`) were counted on the CPU with saved-tensor hooks at each
    family's released widths (bench/models/family_memory_cpu.py): Gemma's two extra norms keep one fp32
    input each; a q/k norm keeps its fp32 input. Layer 0 keeps a little less (its input needs
    no gradient), which the model leaves in as margin.
    """
    h = shape.hidden
    block = shape.block or Block()
    norms = block.norms * FP32 * h
    head_norms = FP32 * (shape.q_dim + shape.kv_dim) if block.head_norm is not HeadNorm.NONE else 0
    dims = shape.linear_dims()
    # Per adapter: dropout mask (1 byte) and the 16-bit copy lora_A saves, per input feature;
    # lora_A's output (r wide) for lora_B.
    adapters = sum((1 + half) * dims[n][0] + half * r for n in shape.adapted(targets))
    return norms + head_norms + mlp_activation_bytes(shape) + attention_bytes(shape, half, seq) + adapters


#: Eager attention's backward, per token, head and key position: the scores' gradient as the
#: second matmul returns it (autocast dtype), cast to fp32 for the softmax's backward, and that
#: backward's fp32 output, live together. Read from the ops, not yet measured on a card.
EAGER_BACKWARD_SCORES = 2 + FP32 + FP32
#: The backward of one block, per token: two fp32 i-wide gradients (the MLP product's backward
#: returns gate's and up's) and two fp32 h-wide ones (the residual's and the block output's).
BACKWARD_TRANSIENT_I = 8
BACKWARD_TRANSIENT_H = 8
#: A MoE block's backward, per routed token: the i-wide pair at the expert's width, and two fp32
#: h-wide gradients, the expert output's and its gathered input's, for every routed token at once
#: (H200, Qwen3-MoE block, top-8: 132 KB a token over seq 2048..8192 = 8 x 8 h; the dense terms
#: alone left it 2.4-6.8 % short).
MOE_BACKWARD_ROUTED_H = 8


def block_backward_bytes(
    shape: ModelShape, knobs: Knobs, targets: tuple[str, ...] | str = DEFAULT_TARGETS, half: int = 2
) -> int:
    """One block's backward on top of what stays kept: with checkpointing its recomputed
    activations, then its fp32 gradients and one dequantized 16-bit weight."""
    tokens = knobs.micro_batch_size * knobs.max_seq_len
    recomputed = (
        layer_activation_bytes(shape, knobs.lora_r, targets, half, knobs.max_seq_len)
        if knobs.gradient_checkpointing
        else 0
    )
    widest = max(a * b for a, b in shape.linear_dims().values())
    if shape.experts:
        routed = BACKWARD_TRANSIENT_I * shape.expert_intermediate + MOE_BACKWARD_ROUTED_H * shape.hidden
        mlp = shape.experts_per_token * routed
    else:
        mlp = BACKWARD_TRANSIENT_I * shape.intermediate
    per_token = recomputed + mlp + BACKWARD_TRANSIENT_H * shape.hidden
    if shape.attn_implementation == "eager":
        per_token += EAGER_BACKWARD_SCORES * shape.heads * knobs.max_seq_len
    return tokens * per_token + widest * half  # bitsandbytes: 4-bit -> its 16-bit storage dtype


def activation_components(
    shape: ModelShape, knobs: Knobs, targets: tuple[str, ...] | str = DEFAULT_TARGETS, half: int = 2
) -> dict[str, int]:
    """What the forward keeps plus the larger of the two moments that start the backward.

    The backward starts in the LM head (all activations kept, plus the head's saved hidden
    states, their gradient and its tiles), then walks the blocks from the last one (kept
    activations, plus one block's backward, :func:`block_backward_bytes`). The peak is whichever
    of the two is larger. (Its end, the first block with every gradient made, is its own phase.)
    """
    tokens = knobs.micro_batch_size * knobs.max_seq_len
    per_layer = layer_activation_bytes(shape, knobs.lora_r, targets, half, knobs.max_seq_len)
    final_norm = FP32 * shape.hidden * tokens
    per_kept_layer = FP32 * shape.hidden if knobs.gradient_checkpointing else per_layer
    # activation_offload (torch.autograd.graph.save_on_cpu): what autograd saves goes to host memory
    # and comes back one block at a time in backward, so one block's share stays on the card.
    on_card = 1 if knobs.activation_offload else shape.layers
    kept = on_card * per_kept_layer * tokens + final_norm  # with checkpointing: each block's fp32 input
    if knobs.gradient_checkpointing:  # the masks every block's recompute is handed, held once
        kept += checkpoint_masks(shape, knobs.micro_batch_size, knobs.max_seq_len)
    block = block_backward_bytes(shape, knobs, targets, half)
    head = loss_components(shape, knobs.micro_batch_size, knobs.max_seq_len, half, knobs.bf16_head)
    if sum(head.values()) >= block:
        return {"activations": kept, **head}
    return {"activations": kept, "backward_block": block}


def loss_components(
    shape: ModelShape, batch: int, seq: int, half: int = 2, bf16_head: bool = False
) -> dict[str, int]:
    """trl's fused LM head in its backward: kept fp32 hidden states, their fp32 gradient, the tiles.

    The tiles: the bf16 logits buffer (one token tile by one vocabulary slice), the bf16 copy of
    the token tile, and one bf16 slice of the head, two while the loop moves to the next slice.
    A head already in bf16 (``bf16_head``) is sliced without a copy: ``.to(bf16)`` is a no-op.
    """
    scored = batch * max(seq - 1, 1)  # every position with a next-token label
    tile_tokens = min(scored, HEAD_TOKEN_TILE)
    tile_vocab = min(shape.vocab, HEAD_VOCAB_TILE)
    slices = 0 if bf16_head else (2 if shape.vocab > HEAD_VOCAB_TILE else 1)
    return {
        "loss_hidden_fp32": scored * shape.hidden * FP32 * 2,
        "loss_tiles": tile_tokens * (tile_vocab + shape.hidden) * half
        + slices * tile_vocab * shape.hidden * half,
    }


def optimizer_components(
    shape: ModelShape, knobs: Knobs, targets: tuple[str, ...] | str = DEFAULT_TARGETS
) -> tuple[dict[str, int], int, int]:
    """(grads and state held by the allocator, the step's temporary, paged state outside it)."""
    adapter = adapter_bytes(shape, knobs, targets)
    held = {"lora_grads": adapter.grads, "optimizer_state": adapter.state}
    return held, adapter.step_temp, adapter.paged


def eval_components(shape: ModelShape, knobs: Knobs, half: int = 2) -> dict[str, int]:
    """An evaluation batch under no_grad: one block's intermediates at a time, and the head."""
    tokens = knobs.eval_batch_size * knobs.max_seq_len
    block = 4 * FP32 * shape.intermediate + 3 * FP32 * shape.hidden
    if shape.attn_implementation == "eager":  # one layer's scores and their fp32 softmax at a time
        block += shape.heads * knobs.max_seq_len * (half + FP32)
    loss = loss_components(shape, knobs.eval_batch_size, knobs.max_seq_len, half, knobs.bf16_head)
    return {"eval_activations": tokens * block, "loss_tiles": loss["loss_tiles"]}


def training_phases(
    shape: ModelShape, knobs: Knobs, targets: tuple[str, ...] | str, half: int
) -> dict[str, dict[str, int]]:
    """Each moment that can hold the peak, by component.

    * load: the base model while its largest 16-bit parameter is cast to fp32 (or the adapter
      in fp32 before trl's bf16 cast);
    * backward: static + optimizer state + kept activations + the head or the last block; the
      gradients only from the second micro-batch of an accumulation (the Trainer zeroes them to
      None after each step, so a step's first backward starts without them);
    * backward_end: the first block's backward with every gradient made;
    * optimizer_step: static + state + grads + the step's temporary;
    * eval (when enabled): static + state + one no-grad batch.
    """
    static = {**static_components(shape, knobs, targets), "blas_workspaces": BLAS_WORKSPACES}
    adapter: AdapterBytes = adapter_bytes(shape, knobs, targets)
    state = {"optimizer_state": adapter.state}
    grads = {"lora_grads": adapter.grads}
    tokens = knobs.micro_batch_size * knobs.max_seq_len
    first_block = block_backward_bytes(shape, knobs, targets, half)
    if not knobs.gradient_checkpointing:  # the first block's own kept activations are still there
        first_block += layer_activation_bytes(shape, knobs.lora_r, targets, half, knobs.max_seq_len) * tokens
    phases: dict[str, dict[str, int]] = {
        "load": load_components(shape, knobs, targets),
        "backward": {
            **static,
            **state,
            **(grads if knobs.grad_accum > 1 else {}),
            **activation_components(shape, knobs, targets, half),
        },
        "backward_end": {**static, **state, **grads, "backward_block": first_block},
        "optimizer_step": {**static, **state, **grads, "optimizer_step_temp": adapter.step_temp},
    }
    if knobs.eval_enabled:
        phases["eval"] = {**static, **state, **eval_components(shape, knobs, half)}
    return phases


def predict(
    shape: ModelShape,
    knobs: Knobs,
    targets: tuple[str, ...] | str = DEFAULT_TARGETS,
    half: int = 2,
) -> Prediction:
    """The peak of loading, training (and evaluating) with ``knobs``: the largest phase of
    :func:`training_phases`, with the allocator's reserve and what sits outside it."""
    phases = training_phases(shape, knobs, targets, half)
    phase, components = max(phases.items(), key=lambda item: sum(item[1].values()))
    peak = sum(components.values())
    fraction = RESERVE_FRACTION_EXPANDABLE if knobs.expandable_segments else RESERVE_FRACTION
    outside = {"cuda_context": CUDA_CONTEXT}
    paged = adapter_bytes(shape, knobs, targets).paged
    if paged:
        outside["paged_optimizer_state"] = paged
    return Prediction(
        components={k: v for k, v in components.items() if v},
        peak_bytes=peak,
        reserved_bytes=int(peak * (1 + fraction)),
        outside=outside,
        phase=phase,
    )
