"""The LoRA adapter's own bytes: its weights, their gradients, and the optimizer's state, per tensor.

Read against the installed libraries (trl 1.16, peft 0.21, torch 2.11, bitsandbytes 0.50):

* **Adapter dtype.** peft creates the adapter in the base layer's compute dtype and, with its
  default ``autocast_adapter_dtype=True``, upcasts it to fp32 (peft/tuners/tuners_utils.py,
  ``cast_adapter_dtype``). trl's SFTTrainer then casts every trainable parameter of a quantized
  model to **bf16** (trl/trainer/sft_trainer.py, "When using QLoRA, the PEFT adapter weights are
  converted to bf16", hard-coded, whatever the compute dtype). So on the 4-bit path the adapter,
  and therefore its gradients, are 2 bytes per parameter; unquantized, peft's fp32 stays.
* **torch AdamW** (``adamw_torch``, ``adamw_torch_fused``): ``exp_avg`` and ``exp_avg_sq`` are
  ``zeros_like(param)``, so two moments in the adapter's dtype. The default foreach step
  (torch/optim/adam.py, ``_multi_tensor_adam``) makes one temporary of the state's size,
  ``exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs)``; the fused kernel makes none.
* **bitsandbytes** (bitsandbytes/optim/optimizer.py, ``Optimizer2State.init_state``): the 32-bit
  kinds keep two fp32 moments whatever the parameter's dtype; the 8-bit kinds keep two uint8
  moments plus two fp32 absmax per block of 256, except for tensors under ``min_8bit_size``
  (4096 elements), which get fp32 moments. A *paged* optimizer puts a moment in CUDA unified
  memory only when its tensor has at least 1e5 elements (``get_state_buffer``); smaller ones
  are ordinary allocations. lora_A of a rank-8 adapter on a 4096-wide layer has 32768 elements,
  so a small adapter's "paged" state is in fact in the allocator.
* **When.** The state is created at the first optimizer step and lives on; the Trainer calls
  ``model.zero_grad()`` (set to None) after each step, so the gradients exist during a backward
  only from the second micro-batch of an accumulation on (see :func:`.gpu.predict`).
"""

from __future__ import annotations

from dataclasses import dataclass

from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.trainer_child.contract.spec import Knobs

FP32 = 4
#: trl casts a quantized model's trainable parameters to bf16.
ADAPTER_BYTES_QUANTIZED = 2
#: bitsandbytes: tensors under this many elements keep fp32 state in the 8-bit optimizers.
BNB_MIN_8BIT_SIZE = 4096
#: bitsandbytes: a paged optimizer pages a state tensor only from this many elements on.
BNB_PAGED_MIN_NUMEL = 100_000
#: bitsandbytes 8-bit blockwise state: one fp32 absmax per block of 256, for each of two moments.
BNB_8BIT_BLOCK = 256
TORCH_ADAMW = frozenset({"adamw_torch", "adamw_torch_fused"})
#: transformers' names of bitsandbytes' 8-bit AdamW (``adamw_bnb_8bit`` is the one ``adamw_8bit``
#: aliases: OptimizerNames; axolotl's and LLaMA-Factory's configs write it).
BNB_8BIT = frozenset({"adamw_8bit", "adamw_bnb_8bit", "paged_adamw_8bit"})
BNB_32BIT = frozenset({"paged_adamw_32bit"})


@dataclass(frozen=True)
class AdapterBytes:
    """The adapter's bytes on the card by where they live, for one config."""

    params: int  # the adapter's weights
    grads: int  # their gradients (same dtype)
    state: int  # optimizer state inside PyTorch's allocator
    paged: int  # optimizer state in CUDA unified memory (outside the allocator)
    step_temp: int  # what the optimizer step allocates on top, for the step's duration


def adapter_dtype_bytes(knobs: Knobs) -> int:
    """Bytes per adapter parameter (and gradient): bf16 on the 4-bit path, fp32 otherwise."""
    return ADAPTER_BYTES_QUANTIZED if knobs.load_in_4bit else FP32


def adapter_tensors(shape: ModelShape, r: int, targets: tuple[str, ...] | str) -> list[int]:
    """The element count of every LoRA weight tensor (lora_A is r x in, lora_B is out x r)."""
    dims = shape.linear_dims()
    per_layer = [n for name in shape.adapted(targets) for n in (r * dims[name][0], dims[name][1] * r)]
    return per_layer * shape.layers


def _bnb_state(numel: int, eight_bit: bool) -> int:
    """bitsandbytes' two moments of one tensor, in bytes."""
    if eight_bit and numel >= BNB_MIN_8BIT_SIZE:
        blocks = -(-numel // BNB_8BIT_BLOCK)
        return 2 * numel + 2 * FP32 * blocks
    return 2 * FP32 * numel


def adapter_bytes(shape: ModelShape, knobs: Knobs, targets: tuple[str, ...] | str) -> AdapterBytes:
    """Weights, gradients and optimizer state of the adapter ``knobs`` and ``targets`` describe.

    An optimizer name outside those modelled (the five the job file accepts, and the bitsandbytes
    8-bit spelling a foreign tool's config may use) is counted as torch AdamW (two moments and a
    step temporary in the allocator): the largest of the kinds modelled.
    """
    tensors = adapter_tensors(shape, knobs.lora_r, targets)
    n = sum(tensors)
    size = adapter_dtype_bytes(knobs)
    name = knobs.optimizer
    state = paged = temp = 0
    if name in BNB_8BIT or name in BNB_32BIT:
        is_paged = name.startswith("paged_")
        for numel in tensors:
            bytes_ = _bnb_state(numel, name in BNB_8BIT)
            if is_paged and numel >= BNB_PAGED_MIN_NUMEL:
                paged += bytes_
            else:
                state += bytes_
    else:
        state = 2 * size * n
        temp = 0 if name == "adamw_torch_fused" else size * n
    return AdapterBytes(params=size * n, grads=size * n, state=state, paged=paged, step_temp=temp)
