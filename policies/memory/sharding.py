"""The base model's bytes on one rank under FSDP-QLoRA (``Knobs.fsdp``), term by term.

What the recipe does under FSDP (trainer_child/recipe/fsdp.py, read against transformers'
``distributed/fsdp.py``, peft's ``fsdp_auto_wrap_policy`` and torch's FSDP1):

* **4-bit weights stored in the compute dtype** (``bnb_4bit_quant_storage``): the packed codes are
  the same bytes viewed as bf16, so FSDP can flatten them with the bf16 parameters of the same unit.
  Nothing is upcast to fp32 (a unit's flat parameter has one dtype), so the embeddings, head and
  norms stay 16-bit.
* **Sharded over the ranks**: each decoder block is one FSDP unit (``FULL_SHARD``), each LoRA
  layer one unit of its own; every rank keeps ``1/world_size`` of every unit. While a block runs,
  its unit is gathered whole, and with backward prefetch the next one too: two gathered blocks.
* **The load** places the whole 4-bit model on every card (:func:`loaded_components`).
* **The root unit** (embeddings, final norm, LM head) is gathered for the forward and again for
  the loss and its backward; it is counted whole on every rank.
* **LoRA, its gradients and the optimizer state** are sharded too; the model counts them whole on
  every rank (:mod:`.optimizer`, as on one card): a small over-estimate (under 1 GB at 70B, r 16)
  that no calibration has yet removed. Activations follow the per-rank micro-batch as on one card.

The per-rank peak has not yet been measured on two cards (bench/scenarios/two_gpus.py awaits them).
"""

from __future__ import annotations

from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.trainer_child.contract.spec import Knobs

#: The compute dtype the 4-bit codes are stored in, and every other parameter's.
STORAGE = 2
#: Blocks gathered at once: the one running and the one backward prefetch brings in.
GATHERED_BLOCKS = 2


def block_bytes(shape: ModelShape, per_weight: float) -> int:
    """One decoder block as FSDP holds it: 4-bit linear layers, 16-bit experts, biases and norms."""
    norms = shape.norm_params // max(shape.layers, 1)
    return int(shape.layer_params * per_weight) + (shape.expert_params + shape.bias_params + norms) * STORAGE


def loaded_components(shape: ModelShape, per_weight: float) -> dict[str, int]:
    """The whole model on every card while it loads: bitsandbytes quantizes on the card, so
    transformers places a 4-bit model on ``cuda:LOCAL_RANK`` whole before the Trainer shards it."""
    head = 0 if shape.tie_word_embeddings else shape.vocab * shape.hidden * STORAGE
    return {
        "weights_4bit": shape.layers * block_bytes(shape, per_weight),
        "embeddings_bf16": shape.vocab * shape.hidden * STORAGE,
        "lm_head_bf16": head,
    }


def sharded_components(shape: ModelShape, knobs: Knobs, per_weight: float) -> dict[str, int]:
    """The base model on one rank: its shard of every block, the gathered blocks, the whole root."""
    block = block_bytes(shape, per_weight)
    ranks = max(knobs.world_size, 1)
    head = 0 if shape.tie_word_embeddings else shape.vocab * shape.hidden * STORAGE
    return {
        "weights_4bit_shard": shape.layers * block // ranks,
        "gathered_blocks": min(GATHERED_BLOCKS, shape.layers) * block,
        "embeddings_bf16": shape.vocab * shape.hidden * STORAGE,
        "lm_head_bf16": head,
    }
