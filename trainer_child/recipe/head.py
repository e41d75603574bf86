"""The bf16 head: the input embeddings and the LM head stay in the compute dtype through k-bit prepare.

``prepare_model_for_kbit_training`` upcasts every parameter that is not 4-bit (fp16/bf16) to fp32:
the norms, and also the embeddings and the LM head, each 2.1 GB in fp32 at a 128k vocabulary (the
issue 19 measurement on the H200: 9.18 GiB peak with the upcast, 6.42 GiB without, +43 % tokens/s).
With ``Knobs.bf16_head`` those two keep the dtype they were loaded in (the compute dtype); the norms
are upcast as before.

How the loss stays stable with a bf16 head (trl 1.16, transformers 5.24, as installed): trl's
SFTTrainer never materializes the logits; its fused head (``trl.trainer.utils.add_fused_lm_head``,
``trl.kernels.chunked_logprob``) multiplies tiles of the hidden states by tiles of the head weight
in the autocast dtype (bf16 on a GPU, with an fp32 head too: the tiles are cast down), or in the
hidden states' dtype without autocast, and accumulates the log-sum-exp in fp32. transformers' own
loss (``ForCausalLMLoss``) upcasts the logits to fp32 before the cross-entropy. So a bf16 head
changes the dtype of the head's weight, not the precision of the loss. Where the head module itself
runs without autocast (a plain forward on the CPU in bf16), :func:`match_head_input` feeds it its
own dtype: the fp32 norm before it would otherwise meet a bf16 weight.

On the CPU the compute dtype is fp32 (:func:`qlora.compute_dtype`): nothing is upcast and the knob
changes nothing unless ``train.compute_dtype`` asks for bf16.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def head_parameters(model: Any) -> list[torch.nn.Parameter]:
    """The parameters of the input embeddings and the LM head, once each (a tied head shares its
    weight with the embeddings: one parameter)."""
    modules = [model.get_input_embeddings(), model.get_output_embeddings()]
    unique: dict[int, torch.nn.Parameter] = {}
    for module in modules:
        if module is None:
            continue
        for parameter in module.parameters():
            unique.setdefault(id(parameter), parameter)
    return list(unique.values())


@contextlib.contextmanager
def kept_out_of_upcast(parameters: list[torch.nn.Parameter], dtype: torch.dtype | None) -> Iterator[None]:
    """Inside: ``parameters`` hold empty stand-ins, so an upcast of the model passes them by; after:
    their own data again, in ``dtype`` (None: as loaded; a no-op when loaded in it, as the recipe
    loads them).

    Casting down after the upcast would give the same values (bf16 -> fp32 -> bf16 is exact), but
    the device would hold each fp32 copy on the way: 2.1 GB more at a 128k vocabulary, at the load,
    which is what an 8 GiB card cannot spare. The stand-ins make the upcast cost nothing.
    """
    saved = [parameter.data for parameter in parameters]
    for parameter, data in zip(parameters, saved, strict=True):
        parameter.data = torch.empty(0, dtype=data.dtype, device=data.device)
    try:
        yield
    finally:
        for parameter, data in zip(parameters, saved, strict=True):
            parameter.data = data if dtype is None else data.to(dtype)


def match_head_input(model: Any) -> None:
    """Cast what enters the LM head to the head's weight dtype (a forward pre-hook): a no-op under
    autocast, which casts it anyway, and what lets a plain forward without autocast run at all."""
    head = model.get_output_embeddings()
    if head is None:
        return

    def to_weight_dtype(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, weight = args[0], module.weight
        if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
            return args
        return args if hidden.dtype == weight.dtype else (hidden.to(weight.dtype), *args[1:])

    head.register_forward_pre_hook(to_weight_dtype)
