"""The bf16 head: the embeddings and the LM head keep the compute dtype through the k-bit prepare.
Its fp32 upcast costs 2.1 GB each at a 128k vocabulary (issue 19, H200: 9.18 GiB peak with it, 6.42
without, +43 % tokens/s). The loss stays fp32 either way (trl's fused head and transformers'
``ForCausalLMLoss`` upcast the logits). On the CPU the compute dtype is fp32: the knob changes nothing."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch


def head_parameters(model: Any) -> list[torch.nn.Parameter]:
    """The parameters of the input embeddings and the LM head, once each (a tied head shares one)."""
    modules = (model.get_input_embeddings(), model.get_output_embeddings())
    unique = {id(param): param for module in modules if module is not None for param in module.parameters()}
    return list(unique.values())


@contextlib.contextmanager
def kept_out_of_upcast(parameters: list[torch.nn.Parameter], dtype: torch.dtype | None) -> Iterator[None]:
    """Inside: ``parameters`` hold empty stand-ins the upcast passes by; after: their data in ``dtype``
    (None: as loaded). Casting down after the upcast would hold each fp32 copy on the device meanwhile."""
    saved = [parameter.data for parameter in parameters]
    for parameter, data in zip(parameters, saved, strict=True):
        parameter.data = torch.empty(0, dtype=data.dtype, device=data.device)
    try:
        yield
    finally:
        for parameter, data in zip(parameters, saved, strict=True):
            parameter.data = data if dtype is None else data.to(dtype)


def match_head_input(model: Any) -> None:
    """Cast the LM head's input to its weight dtype: without autocast, the fp32 norm's output meets bf16."""
    if (head := model.get_output_embeddings()) is None:
        return

    def to_weight_dtype(module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden, weight = args[0], module.weight
        if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
            return args
        return args if hidden.dtype == weight.dtype else (hidden.to(weight.dtype), *args[1:])

    head.register_forward_pre_hook(to_weight_dtype)
