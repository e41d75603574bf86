"""Where activations live: gradient checkpointing switched on a built model, and activation offload.

Both are throughput knobs that change without a reload: the speed trial switches checkpointing
on and off on the model it times (:mod:`...run.speed_trial`), and the trainer runs each micro-step
under :func:`activation_context`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from qlora_supervise.trainer_child.contract.spec import Knobs

#: The one set of checkpointing kwargs: prepare_model_for_kbit_training, SFTConfig and the speed
#: trial all use it. Non-reentrant: it needs no input gradients and works with frozen 4-bit layers.
CHECKPOINTING_KWARGS: dict[str, Any] = {"use_reentrant": False}
#: Saved tensors smaller than this stay where they are: copying them costs more than they free.
MIN_OFFLOAD_BYTES = 1024


def checkpointing_kwargs() -> dict[str, Any]:
    """A fresh copy of :data:`CHECKPOINTING_KWARGS` (the libraries keep and may mutate what they get)."""
    return dict(CHECKPOINTING_KWARGS)


def set_checkpointing(trainer: Any, enabled: bool) -> None:
    """Turn gradient checkpointing on or off on ``trainer``'s model, and in its arguments.

    The arguments matter as much as the model: ``Trainer.train`` turns checkpointing on again when
    ``args.activation_checkpointing`` (``gradient_checkpointing``, its deprecated alias in
    transformers 5) is set, and never turns it off.
    """
    model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    # transformers 5 names them activation_checkpointing_*; gradient_checkpointing_* are deprecated
    # aliases that warn on every call.
    if enabled:
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable(activation_checkpointing_kwargs=checkpointing_kwargs())
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing_kwargs())
    else:
        disable = getattr(model, "activation_checkpointing_disable", None)
        (disable or model.gradient_checkpointing_disable)()
    args = trainer.args
    if hasattr(args, "activation_checkpointing"):
        args.activation_checkpointing = enabled
    args.gradient_checkpointing = enabled


def offloads(tensor: torch.Tensor) -> bool:
    """Whether a tensor saved for backward goes to the host: an activation on an accelerator.

    Parameters stay (torchtune's OffloadActivations leaves them too): a frozen weight that an op
    saves, such as the LM head's in trl's fused loss, would otherwise be copied to the host and back
    on every micro-step, gigabytes at a 128k vocabulary, for no memory gained (it stays resident).
    Tensors already on the host, and tiny ones, stay as well.
    """
    if isinstance(tensor, torch.nn.Parameter) or tensor.device.type == "cpu":
        return False
    return tensor.numel() * tensor.element_size() >= MIN_OFFLOAD_BYTES


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """``torch.autograd.graph.save_on_cpu``, less the tensors :func:`offloads` keeps in place.

    Activations saved for backward are copied to host memory (pinned where a GPU makes that
    useful) in the forward, and back in the backward: device memory for host memory and copies.
    """

    def __init__(self, pin_memory: bool) -> None:
        def pack(tensor: torch.Tensor) -> Any:
            if not offloads(tensor):
                return tensor
            packed = torch.empty(
                tensor.size(), dtype=tensor.dtype, layout=tensor.layout, pin_memory=pin_memory
            )
            packed.copy_(tensor)
            return (tensor.device, packed)

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            device, tensor = packed
            result: torch.Tensor = tensor.to(device, non_blocking=pin_memory)
            return result

        super().__init__(pack, unpack)


@contextlib.contextmanager
def activation_context(knobs: Knobs) -> Iterator[None]:
    """What a training micro-step (forward and backward) runs under: activation offload when the
    knob is on (torchtune wraps its steps the same way), else nothing."""
    if not knobs.activation_offload:
        yield
        return
    with OffloadActivations(pin_memory=torch.cuda.is_available()):
        yield
