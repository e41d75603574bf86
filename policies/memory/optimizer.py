"""The LoRA adapter's own bytes: its weights, their gradients, and the optimizer's state, per tensor.
Read against trl 1.16, peft 0.21, torch 2.11 and bitsandbytes 0.50: trl casts a quantized model's
adapter to bf16 (unquantized, peft's fp32 stays); torch AdamW keeps two moments in the adapter's
dtype plus a foreach step temporary (none fused); bitsandbytes keeps two fp32 moments, or uint8 ones
with an fp32 absmax per 256 for tensors of ``min_8bit_size`` or more, and a paged optimizer pages
only tensors of 1e5 elements or more (smaller ones are ordinary allocations)."""

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


def adapter_tensors(shape: ModelShape, r: int, targets: tuple[str, ...] | str) -> list[int]:
    """The element count of every LoRA weight tensor (lora_A is r x in, lora_B is out x r)."""
    dims = shape.linear_dims()
    per_layer = [n for name in shape.adapted(targets) for n in (r * dims[name][0], dims[name][1] * r)]
    return per_layer * shape.layers


def adapter_bytes(shape: ModelShape, knobs: Knobs, targets: tuple[str, ...] | str) -> AdapterBytes:
    """Weights, gradients and optimizer state of the adapter ``knobs`` and ``targets`` describe; an
    optimizer outside those modelled counts as torch AdamW, the largest of them."""
    tensors = adapter_tensors(shape, knobs.lora_r, targets)
    n = sum(tensors)
    size = adapter_dtype_bytes(knobs)
    name = knobs.optimizer
    state = paged = temp = 0
    if name in BNB_8BIT or name in BNB_32BIT:
        is_paged = name.startswith("paged_")
        for numel in tensors:  # bitsandbytes' two moments of each tensor
            if name in BNB_8BIT and numel >= BNB_MIN_8BIT_SIZE:
                bytes_ = 2 * numel + 2 * FP32 * -(-numel // BNB_8BIT_BLOCK)
            else:
                bytes_ = 2 * FP32 * numel
            if is_paged and numel >= BNB_PAGED_MIN_NUMEL:
                paged += bytes_
            else:
                state += bytes_
    else:
        state = 2 * size * n
        temp = 0 if name == "adamw_torch_fused" else size * n
    return AdapterBytes(params=size * n, grads=size * n, state=state, paged=paged, step_temp=temp)
