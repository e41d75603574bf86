"""Where activations live: gradient checkpointing switched on a built model, and activation offload.

Both are throughput knobs that change without a reload: the speed trial switches checkpointing
on and off on the model it times (:mod:`...run.speed_trial`), and the trainer runs each micro-step
under :func:`activation_context`.
"""

from __future__ import annotations

import contextlib
import weakref
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
    So do views of them (``F.linear`` saves ``weight.t()``, a view whose base is the parameter).
    Tensors already on the host, and tiny ones, stay as well.
    """
    if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
        return False
    if tensor.device.type == "cpu":
        return False
    return tensor.numel() * tensor.element_size() >= MIN_OFFLOAD_BYTES


class HostBuffers:
    """The host buffers offloaded activations live in, kept between micro-steps.

    ``save_on_cpu`` allocates a new (pinned) host tensor for every saved tensor of every micro-step;
    pinned allocations go through the host caching allocator, which keeps them (and rounds each
    up to a power of two), so a run's host memory only ever grows. Here a buffer is a byte buffer
    of the saved tensor's size rounded up to a power of two (the allocator's rounding, which the
    host model's ``pinned()`` counts), viewed as the tensor's dtype; it is taken from the free list
    of its size when one is there, and goes back to it when autograd drops what it saved (after
    the backward that used it): the next micro-step's forward copies into the same buffers. Sizes
    are rounded, not exact, because trl's collator pads each batch to its own longest row: exact
    sizes would allocate new buffers at nearly every micro-step and keep all the old ones.
    :meth:`release` gives them all back (to the operating system, through the host allocator's
    cache) when the config changes or the speed trial ends.

    The counters are the bookkeeping the tests and the child's heartbeats read: bytes held (in use
    and free), the peak in use, how many buffers were allocated and how many reuses were served.
    """

    def __init__(self, pin_memory: bool) -> None:
        self.pin_memory = pin_memory
        self._free: dict[int, list[torch.Tensor]] = {}  # by size in bytes, a power of two
        self.held_bytes = 0  # every buffer this pool allocated and still holds (in use + free)
        self.in_use_bytes = 0
        self.peak_in_use_bytes = 0
        self.allocated = 0  # buffers allocated (a new host tensor)
        self.reused = 0  # packs served from the free list
        self.packed = 0  # tensors offloaded

    def take(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host byte buffer (its size a power of two) whose first bytes hold ``tensor``'s contents:
        :func:`as_saved` views it as the tensor again."""
        nbytes = _nbytes(tensor)
        size = _bucket(nbytes)
        free = self._free.get(size)
        if free:
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
        """``buffer`` is free again: the next micro-step's forward may copy into it."""
        self.in_use_bytes -= buffer.numel()
        self._free.setdefault(buffer.numel(), []).append(buffer)

    def release(self) -> int:
        """Drop every free buffer and empty the host allocator's cache; the bytes dropped."""
        dropped = sum(b.numel() for buffers in self._free.values() for b in buffers)
        self._free.clear()
        self.held_bytes -= dropped
        empty_host_cache()
        return dropped


def as_saved(buffer: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> torch.Tensor:
    """The tensor :meth:`HostBuffers.take` copied into ``buffer``: its first bytes, as ``dtype`` and
    ``shape``."""
    return buffer[: shape.numel() * dtype.itemsize].view(dtype).view(shape)


def _bucket(nbytes: int) -> int:
    """``nbytes`` rounded up to a power of two (the host caching allocator's rounding)."""
    return 1 << max(nbytes - 1, 0).bit_length()


class _Offloaded:
    """What autograd keeps for one offloaded tensor; its buffer returns to the pool when autograd
    drops it (after the backward that read it, or with a graph that is never run backward)."""

    __slots__ = ("buffer", "device", "dtype", "pool", "shape")

    def __init__(self, pool: HostBuffers, tensor: torch.Tensor) -> None:
        self.pool = pool
        self.device = tensor.device
        self.dtype = tensor.dtype
        self.shape = tensor.shape
        self.buffer = pool.take(tensor)

    def __del__(self) -> None:
        self.pool.give_back(self.buffer)


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """``torch.autograd.graph.save_on_cpu``, less the tensors :func:`offloads` keeps in place, into
    the reused buffers of ``pool``.

    Only what the forward saves for backward is offloaded. With (non-reentrant) checkpointing that
    is each block's input: the checkpoint's own hooks keep the block's inner tensors out of ours,
    and a tensor saved while the backward runs (a reentrant checkpoint's recomputation) stays where
    it is: it is read back within the same backward, so copying it out would only cost host memory.
    """

    def __init__(self, pool: HostBuffers) -> None:
        # The same tensor saved by two ops (an RMSNorm's input: by its square and by its product)
        # is copied once: while the tensor lives, its first copy is handed out again.
        seen: dict[int, tuple[weakref.ref[torch.Tensor], _Offloaded]] = {}

        def pack(tensor: torch.Tensor) -> Any:
            if not offloads(tensor) or in_backward():
                return tensor
            earlier = seen.get(id(tensor))
            if earlier is not None and earlier[0]() is tensor:
                return earlier[1]
            packed = _Offloaded(pool, tensor)
            seen[id(tensor)] = (weakref.ref(tensor), packed)
            return packed

        def unpack(packed: Any) -> torch.Tensor:
            if isinstance(packed, torch.Tensor):
                return packed
            host = as_saved(packed.buffer, packed.dtype, packed.shape)
            result: torch.Tensor = host.to(packed.device, non_blocking=pool.pin_memory)
            return result

        super().__init__(pack, unpack)


def in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (a recomputation's saves)."""
    return bool(torch._C._current_graph_task_id() != -1)


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def empty_host_cache() -> None:
    """Give the host allocator's cached pinned blocks back to the operating system (a no-op where
    none was ever allocated; torch 2.11 names it ``_host_emptyCache``, later ones
    ``torch.accelerator.empty_host_cache``)."""
    accelerator = getattr(torch, "accelerator", None)
    empty = getattr(accelerator, "empty_host_cache", None) or getattr(torch._C, "_host_emptyCache", None)
    if empty is not None and torch.cuda.is_available():
        empty()


_POOL: HostBuffers | None = None


def host_buffers() -> HostBuffers:
    """The process's pool of offload buffers (pinned where a GPU makes that useful)."""
    global _POOL
    if _POOL is None:
        _POOL = HostBuffers(pin_memory=torch.cuda.is_available())
    return _POOL


def release_host_buffers() -> int:
    """Give back the offload buffers no micro-step holds: after the speed trial, and whenever the
    config changes in-process (another micro-batch or checkpointing saves other sizes). The bytes
    given back."""
    return 0 if _POOL is None else _POOL.release()


@contextlib.contextmanager
def activation_context(knobs: Knobs) -> Iterator[None]:
    """What a training micro-step (forward and backward) runs under: activation offload when the
    knob is on (torchtune wraps its steps the same way), else nothing."""
    if not knobs.activation_offload:
        yield
        return
    with OffloadActivations(host_buffers()):
        yield
