"""Peak GPU memory of one QLoRA training attempt of our recipe, term by term, in bytes.

What the recipe does to memory (trainer_child/recipe.py, read against the installed libraries):

* **4-bit weights.** bitsandbytes NF4 stores two weights per byte, plus one absmax per block of
  64 weights: with double quantization that absmax is 8-bit, with one fp32 absmax per 256 blocks
  on top (``0.5 + 1/64 + 4/16384`` bytes per weight); without it, fp32 (``0.5 + 4/64``).
* **Everything not quantized is fp32.** peft's ``prepare_model_for_kbit_training`` casts every
  16-bit parameter that is not ``Params4bit`` to fp32 (peft/utils/other.py): the embeddings, the
  LM head (bitsandbytes never quantizes it), every RMSNorm weight. A 128k vocabulary at hidden
  4096 is therefore 2.1 GB per matrix, twice when untied.
* **LoRA** adapters are created in fp32 (peft keeps them fp32 on 4-bit layers); their gradients
  are fp32; AdamW keeps two fp32 moments (8 bytes per parameter) and its foreach step makes one
  fp32 temporary of the same size; bitsandbytes' 8-bit AdamW keeps two 8-bit moments. The
  *paged* optimizers put their state in CUDA unified memory, outside PyTorch's allocator: it is
  on the card but not in ``max_memory_allocated``, so it is its own component (``paged_state``)
  that counts toward the card, not toward the allocated peak.
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
  ``add_fused_lm_head``): log-probabilities, entropy and top-1 accuracy are folded tile by tile
  (4096 tokens x 32768 vocabulary entries, bf16), so the ``tokens x vocab`` logits are never
  materialised. It keeps the gathered fp32 hidden states for backward and builds an fp32
  gradient of the same size; the tiles and the bf16 copy of a 32768-row slice of the fp32 head
  are transients.
* **Backward transients.** The backward of one block holds fp32 gradients of its widest
  intermediates, and bitsandbytes dequantizes a 4-bit weight to 16-bit, then to the gradient's
  fp32, for ``grad_input``.

The coefficients that are not exact byte counts (the backward transient of one block, the
allocator's reserve) were fitted on the H200 grid in bench/results/memory-grid-h200-*/ and are
named constants below; :mod:`.calibration` corrects the rest per run.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from qlora_supervise.policies.memory.shape import ATTENTION_MODULES, ModelShape, resolve_targets
from qlora_supervise.trainer_child.protocol import Knobs

GiB = 1 << 30
DEFAULT_TARGETS: tuple[str, ...] = ATTENTION_MODULES

#: Bytes per quantized weight: packed 4-bit codes plus the per-block absmax (blocksize 64).
NF4_DOUBLE_QUANT = 0.5 + 1 / 64 + 4 / (64 * 256)
NF4_SINGLE_QUANT = 0.5 + 4 / 64
#: fp32: what prepare_model_for_kbit_training leaves every non-quantized parameter in.
FP32 = 4
#: Optimizer state per trainable parameter held by PyTorch's allocator, and its step temporary.
OPTIMIZER_STATE = {
    "adamw_torch": 8,
    "adamw_torch_fused": 8,
    "adamw_8bit": 2,
    "paged_adamw_8bit": 0,
    "paged_adamw_32bit": 0,
}
OPTIMIZER_STEP_TEMP = {"adamw_torch": 4}
#: Optimizer state in CUDA unified memory (paged): on the card, outside the allocator.
PAGED_STATE = {"paged_adamw_8bit": 2, "paged_adamw_32bit": 8}
#: trl's fused LM head tiles (trl/kernels/chunked_logprob.py).
HEAD_TOKEN_TILE = 4096
HEAD_VOCAB_TILE = 32768
#: Outside the allocator: the CUDA context, cuBLAS handles and kernels (H200, torch 2.11).
CUDA_CONTEXT = 600 << 20
#: Reserved over allocated at the peak; the caching allocator rounds and keeps split blocks.
RESERVE_FRACTION = 0.08
RESERVE_FRACTION_EXPANDABLE = 0.02


@dataclass(frozen=True)
class Prediction:
    """A predicted peak, by component (bytes).

    ``peak_bytes`` is the peak PyTorch *allocated* (``torch.cuda.max_memory_allocated``, what
    ``gpu_memory_limit`` caps); ``components`` sums to it. ``outside`` holds what is on the card
    but outside the allocator (CUDA context, paged optimizer state), and ``reserved_bytes`` is
    the allocator's peak reserve; ``card_bytes`` is what the card must hold.
    """

    components: Mapping[str, int]
    peak_bytes: int
    reserved_bytes: int
    outside: Mapping[str, int] = field(default_factory=dict)
    phase: str = "backward"  # where the peak happens: backward, optimizer_step or eval

    @property
    def card_bytes(self) -> int:
        return self.reserved_bytes + sum(self.outside.values())


def lora_params(shape: ModelShape, r: int, targets: tuple[str, ...] | str) -> int:
    dims = shape.linear_dims()
    return shape.layers * sum(r * (dims[n][0] + dims[n][1]) for n in resolve_targets(targets))


def static_components(
    shape: ModelShape, knobs: Knobs, targets: tuple[str, ...] | str = DEFAULT_TARGETS
) -> dict[str, int]:
    """What sits on the card once the model is loaded and the adapter attached."""
    quantized = shape.layers * shape.layer_params
    if knobs.load_in_4bit:
        per_weight = NF4_DOUBLE_QUANT if knobs.double_quant else NF4_SINGLE_QUANT
        weights = int(quantized * per_weight)
    else:
        weights = quantized * FP32  # prepare_model_for_kbit_training upcasts 16-bit weights too
    return {
        "weights_4bit" if knobs.load_in_4bit else "weights_fp32": weights,
        "embeddings_fp32": shape.vocab * shape.hidden * FP32,
        "lm_head_fp32": 0 if shape.tie_word_embeddings else shape.vocab * shape.hidden * FP32,
        "norms_fp32": shape.norm_params * FP32,
        "lora_params": lora_params(shape, knobs.lora_r, targets) * FP32,
    }


def layer_activation_bytes(shape: ModelShape, r: int, targets: tuple[str, ...] | str, half: int = 2) -> int:
    """Bytes autograd keeps per token for one decoder block (no checkpointing).

    ``half`` is the autocast dtype's size (2 for bf16/fp16, 4 when training in fp32 on the CPU).
    """
    h, i = shape.hidden, shape.intermediate
    norms = 2 * FP32 * h
    mlp = 3 * FP32 * i
    attention = half * (2 * shape.q_dim + 2 * shape.kv_dim)
    dims = shape.linear_dims()
    # Per adapter: dropout mask (1 byte) and the 16-bit copy lora_A saves, per input feature;
    # lora_A's output (r wide) for lora_B.
    adapters = sum((1 + half) * dims[n][0] + half * r for n in resolve_targets(targets))
    return norms + mlp + attention + adapters


#: The backward of one block, per token: fp32 gradients of the MLP's widest intermediates and of
#: the block's output (fitted on the H200: 7B, seq 2048, micro-batch 4, checkpointing, 11.10 GiB).
BACKWARD_TRANSIENT_I = 8
BACKWARD_TRANSIENT_H = 8


def activation_components(
    shape: ModelShape, knobs: Knobs, targets: tuple[str, ...] | str = DEFAULT_TARGETS, half: int = 2
) -> dict[str, int]:
    """What the forward keeps plus the larger of the two backward moments that peak.

    The backward starts in the LM head (all activations kept, plus the head's saved hidden
    states, their gradient and its tiles), then walks the blocks from the last one (kept
    activations, plus one block's gradients and a dequantized weight; with checkpointing also
    that block's recomputed activations). The peak is whichever of the two is larger.
    """
    tokens = knobs.micro_batch_size * knobs.max_seq_len
    per_layer = layer_activation_bytes(shape, knobs.lora_r, targets, half)
    final_norm = FP32 * shape.hidden * tokens
    if knobs.gradient_checkpointing:
        kept = shape.layers * FP32 * shape.hidden * tokens + final_norm  # each block's fp32 input
        recomputed = per_layer * tokens
    else:
        kept = shape.layers * per_layer * tokens + final_norm
        recomputed = 0
    widest = max(a * b for a, b in shape.linear_dims().values())
    block = recomputed + tokens * (
        BACKWARD_TRANSIENT_I * shape.intermediate + BACKWARD_TRANSIENT_H * shape.hidden
    )
    block += widest * (half + FP32)  # bitsandbytes: 4-bit -> 16-bit -> the gradient's fp32
    head = loss_components(shape, knobs.micro_batch_size, knobs.max_seq_len, half)
    if sum(head.values()) >= block:
        return {"activations": kept, **head}
    return {"activations": kept, "backward_block": block}


def loss_components(shape: ModelShape, batch: int, seq: int, half: int = 2) -> dict[str, int]:
    """trl's fused LM head in its backward: kept fp32 hidden states, their fp32 gradient, the tiles."""
    scored = batch * max(seq - 1, 1)  # every position with a next-token label
    tile_tokens = min(scored, HEAD_TOKEN_TILE)
    tile_vocab = min(shape.vocab, HEAD_VOCAB_TILE)
    return {
        "loss_hidden_fp32": scored * shape.hidden * FP32 * 2,
        "loss_tiles": tile_tokens * tile_vocab * half + tile_vocab * shape.hidden * half,
    }


def optimizer_components(
    shape: ModelShape, knobs: Knobs, targets: tuple[str, ...] | str = DEFAULT_TARGETS
) -> tuple[dict[str, int], int, int]:
    """(state and grads held by the allocator, the step's temporary, paged state outside it)."""
    n = lora_params(shape, knobs.lora_r, targets)
    held = {"lora_grads": n * FP32, "optimizer_state": n * OPTIMIZER_STATE.get(knobs.optimizer, 8)}
    return held, n * OPTIMIZER_STEP_TEMP.get(knobs.optimizer, 0), n * PAGED_STATE.get(knobs.optimizer, 0)


def eval_components(shape: ModelShape, knobs: Knobs, half: int = 2) -> dict[str, int]:
    """An evaluation batch under no_grad: one block's intermediates at a time, and the head."""
    tokens = knobs.eval_batch_size * knobs.max_seq_len
    block = 4 * FP32 * shape.intermediate + 3 * FP32 * shape.hidden
    loss = loss_components(shape, knobs.eval_batch_size, knobs.max_seq_len, half)
    return {"eval_activations": tokens * block, "loss_tiles": loss["loss_tiles"]}


def predict(
    shape: ModelShape,
    knobs: Knobs,
    targets: tuple[str, ...] | str = DEFAULT_TARGETS,
    half: int = 2,
) -> Prediction:
    """The peak of training (and evaluating) with ``knobs``: the largest of three phases.

    * backward: static + optimizer state + grads + activations + backward transients + loss;
    * optimizer step: static + state + grads + the step's temporary;
    * eval (when enabled): static + state + one no-grad batch.
    """
    static = static_components(shape, knobs, targets)
    held, step_temp, paged = optimizer_components(shape, knobs, targets)
    phases: dict[str, dict[str, int]] = {
        "backward": {**static, **held, **activation_components(shape, knobs, targets, half)},
        "optimizer_step": {**static, **held, "optimizer_step_temp": step_temp},
    }
    if knobs.eval_enabled:
        phases["eval"] = {
            **static,
            "optimizer_state": held["optimizer_state"],
            **eval_components(shape, knobs, half),
        }
    phase, components = max(phases.items(), key=lambda item: sum(item[1].values()))
    peak = sum(components.values())
    fraction = RESERVE_FRACTION_EXPANDABLE if knobs.expandable_segments else RESERVE_FRACTION
    outside = {"cuda_context": CUDA_CONTEXT}
    if paged:
        outside["paged_optimizer_state"] = paged
    return Prediction(
        components={k: v for k, v in components.items() if v},
        peak_bytes=peak,
        reserved_bytes=int(peak * (1 + fraction)),
        outside=outside,
        phase=phase,
    )
