"""Where activations live: checkpointing switched on a built model, and activation offload (no reload)."""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

import torch

from qlora_supervise.trainer_child.contract.spec import Knobs

#: Saved tensors smaller than this stay where they are: copying them costs more than they free.
MIN_OFFLOAD_BYTES = 1024


def checkpointing_kwargs() -> dict[str, Any]:
    """The one set of checkpointing kwargs, a fresh copy each time (the libraries keep and may mutate
    what they get). Non-reentrant: it needs no input gradients and works with frozen 4-bit layers."""
    return {"use_reentrant": False}


def set_checkpointing(trainer: Any, enabled: bool) -> None:
    """Checkpointing on or off on ``trainer``'s model and in its arguments (``Trainer.train`` turns it
    on again when the arguments say so, and never off)."""
    model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    # transformers 5's activation_checkpointing_*; gradient_checkpointing_* are aliases that warn.
    if enabled:
        if (enable := getattr(model, "activation_checkpointing_enable", None)) is not None:
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
    """Whether a tensor saved for backward goes to the host: an activation on an accelerator, not tiny.
    Parameters and their views stay (as in torchtune): a frozen weight an op saves, such as the LM
    head's in trl's fused loss, would be copied out and back every micro-step for nothing."""
    parameter = isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)
    return not parameter and tensor.device.type != "cpu" and tensor.nbytes >= MIN_OFFLOAD_BYTES


class HostBuffers:
    """Host buffers for offloaded activations, reused between micro-steps (``save_on_cpu`` pins new ones
    each micro-step, and the host caching allocator keeps them all), sized to a power of two as the
    allocator rounds (the host model counts it; trl pads each batch to its own length)."""

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._free: dict[int, list[torch.Tensor]] = {}  # by size in bytes, a power of two
        self.held_bytes = 0  # every buffer this pool allocated and still holds (in use + free)
        self.in_use_bytes = self.peak_in_use_bytes = 0
        # Counts: buffers allocated (a new host tensor), packs served from the free list, tensors offloaded.
        self.allocated = self.reused = self.packed = 0

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host buffer whose first bytes hold ``tensor``."""
        nbytes = tensor.nbytes
        size = 1 << max(nbytes - 1, 0).bit_length()
        if free := self._free.get(size):
            buffer = free.pop()
            self.reused += 1
        else:
            buffer = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin_memory)
            self.allocated += 1
            self.held_bytes += size
        buffer[:nbytes].view(tensor.dtype).copy_(tensor.reshape(-1))
        self.packed += 1
        self.in_use_bytes += size
        self.peak_in_use_bytes = max(self.peak_in_use_bytes, self.in_use_bytes)
        return buffer

    def give_back(self, buffer: torch.Tensor) -> None:
        self.in_use_bytes -= buffer.numel()
        self._free.setdefault(buffer.numel(), []).append(buffer)

    def release(self) -> int:
        """Drop every free buffer and empty the host allocator's cache; the bytes dropped."""
        dropped = sum(b.numel() for buffers in self._free.values() for b in buffers)
        self._free.clear()
        self.held_bytes -= dropped
        # The host allocator's cached pinned blocks back too (``_host_emptyCache`` in torch 2.11).
        accelerator = getattr(torch, "accelerator", None)
        empty = getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
        if empty is not None and torch.cuda.is_available():
            empty()
        return dropped


class _Offloaded:
    """What autograd keeps for one offloaded tensor; its buffer goes back to the pool when dropped."""

    __slots__ = ("buffer", "device", "dtype", "pool", "shape")

    def __init__(self, pool: HostBuffers, tensor: torch.Tensor) -> None:
        self.pool, self.device, self.dtype, self.shape = pool, tensor.device, tensor.dtype, tensor.shape
        self.buffer = pool.take(tensor)

    def __del__(self) -> None:
        self.pool.give_back(self.buffer)

    def saved(self) -> torch.Tensor:
        """The buffer's first bytes, viewed as the tensor that was saved."""
        return self.buffer[: self.shape.numel() * self.dtype.itemsize].view(self.dtype).view(self.shape)


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """``save_on_cpu``, less what :func:`offloads` keeps in place, into the reused buffers of ``pool``.
    A tensor saved during the backward (a reentrant recomputation) is read back in it, so it stays."""

    def __init__(self, pool: HostBuffers) -> None:
        # A tensor saved by two ops (an RMSNorm's input) is copied once, while it lives.
        seen: dict[int, tuple[weakref.ref[torch.Tensor], _Offloaded]] = {}

        def pack(tensor: torch.Tensor) -> Any:
            if not offloads(tensor) or torch._C._current_graph_task_id() != -1:  # saved in a backward
                return tensor
            if (earlier := seen.get(id(tensor))) is not None and earlier[0]() is tensor:
                return earlier[1]
            packed = _Offloaded(pool, tensor)
            seen[id(tensor)] = (weakref.ref(tensor), packed)
            return packed

        def unpack(packed: torch.Tensor | _Offloaded) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            return packed.saved().to(packed.device, non_blocking=pool.pin_memory)

        super().__init__(pack, unpack)


_POOL: HostBuffers | None = None


def release_host_buffers() -> int:
    """Give back the buffers no micro-step holds; the bytes given back."""
    return 0 if _POOL is None else _POOL.release()


def activation_context(knobs: Knobs) -> contextlib.AbstractContextManager[Any]:
    global _POOL
    if not knobs.activation_offload:
        return contextlib.nullcontext()
    if _POOL is None:
        _POOL = HostBuffers(pin_memory=torch.cuda.is_available())
    return OffloadActivations(_POOL)
