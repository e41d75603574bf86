"""Host memory: loading a checkpoint into 4-bit, merging the adapter, and training (the host's budget).
Measured, not derived (docs/host-memory.md says how it counts): safetensors maps the checkpoint,
so every page of the 16-bit checkpoint passes through the loading process's resident set; on the
H200 host a 7B (13.5 GB in bf16) peaked at 14.6 GB RSS while loading into 4-bit."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from qlora_supervise.policies.memory.gpu import DEFAULT_TARGETS, FP32, adapter_bytes, layer_activation_bytes
from qlora_supervise.policies.memory.shape import ModelShape, Targets
from qlora_supervise.trainer_child.contract.spec import Knobs

#: RSS of the child after importing torch (CUDA build), transformers, peft, trl, bitsandbytes.
IMPORTS_RSS = 1_600_000_000
#: The same imports with torch's CPU build (0.50 GB peak RSS on the 2-core CPU host).
CPU_IMPORTS_RSS = 500_000_000
#: Peak RSS while loading, per byte of the 16-bit checkpoint (mapped pages + conversion buffers).
LOAD_PER_CHECKPOINT_BYTE = 0.97
#: A merge loads the base in 16-bit on the CPU and writes the merged shards (one at a time).
MERGE_PER_CHECKPOINT_BYTE = 1.05


@dataclass(frozen=True)
class HostNeed:
    """Host RAM a phase needs at its peak, in bytes, and how it was computed."""

    load_peak: int
    merge_peak: int
    basis: str


def host_need(checkpoint_bytes: int, largest_shard_bytes: int = 0, on_gpu: bool = True) -> HostNeed:
    """Peak RSS to load a ``checkpoint_bytes`` 16-bit checkpoint into 4-bit, and to merge onto it;
    ``on_gpu`` False: a CPU run, whose imports are the CPU build's."""
    imports = IMPORTS_RSS if on_gpu else CPU_IMPORTS_RSS
    load = imports + int(checkpoint_bytes * LOAD_PER_CHECKPOINT_BYTE)
    merge = imports + int(checkpoint_bytes * MERGE_PER_CHECKPOINT_BYTE) + largest_shard_bytes
    build = "" if on_gpu else " (the CPU build's)"
    basis = (
        f"imports {imports / 1e9:.1f} GB{build} + {LOAD_PER_CHECKPOINT_BYTE:.2f} x the 16-bit checkpoint to "
        f"load (measured on the H200 host: 7B, 13.5 GB checkpoint, 14.6 GB peak RSS); merge: "
        f"{MERGE_PER_CHECKPOINT_BYTE:.2f} x checkpoint + one shard being written"
    )
    return HostNeed(load, merge, basis)


#: RSS of a training child besides offloaded activations: imports, the CUDA context's host side,
#: the data, autograd's bookkeeping (H200, torch 2.11: 2.03-2.19 GB over every 7B and 8B run).
TRAIN_RESIDENT_RSS = 2_150_000_000
#: The int64 tensors of a collated batch the data loader pins (input ids, attention mask, labels).
BATCH_TENSORS = 3
INT64 = 8


@dataclass(frozen=True)
class HostTrainNeed:
    """Host RAM one training config needs (bytes): the load's peak RSS (``load_peak``, as measured),
    what of the load the host must hold (``load_need``: the imports and the shard being read; the
    rest is clean file pages the kernel reclaims), the training phase's by component, and the
    larger of the last two (``peak_bytes``, what the host budget must hold)."""

    load_peak: int
    train_components: Mapping[str, int] = field(default_factory=dict)
    basis: str = ""
    load_need: int = 0

    @property
    def train_peak(self) -> int:
        return sum(self.train_components.values())

    @property
    def peak_bytes(self) -> int:
        return max(self.load_need, self.train_peak)

    @property
    def phase(self) -> str:
        """Where the host need peaks: ``load`` or ``train``."""
        return "load" if self.load_need >= self.train_peak else "train"


def pinned(nbytes: int) -> int:
    """What the host caching allocator takes for a pinned block of ``nbytes``: the next power of two."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


def offloaded_bytes(
    shape: ModelShape, knobs: Knobs, targets: Targets = DEFAULT_TARGETS, pin: bool = True
) -> int:
    """Host bytes activation offload holds at the end of one micro-step's forward (0 when off), in
    reused pinned buffers: with checkpointing each block's input, without it every block's saved
    activations (rounded as its hidden-wide tensors are); and the final norm's and the head's input."""
    if not knobs.activation_offload:
        return 0
    tokens = knobs.micro_batch_size * knobs.max_seq_len
    # The residual stream (a checkpointed block's input) is fp32, but 2 bytes where the norms keep
    # their input's dtype (Gemma) with the bf16 embeddings.
    keeps = shape.block is not None and shape.block.norm_keeps_dtype and knobs.bf16_head
    hidden = tokens * shape.hidden * (2 if keeps else FP32)
    block_input = pinned(hidden) if pin else hidden
    if knobs.gradient_checkpointing:
        return (shape.layers + 2) * block_input
    per_layer = layer_activation_bytes(shape, knobs.lora_r, targets, 2, knobs.max_seq_len) * tokens
    return int(shape.layers * per_layer * block_input / hidden) + 2 * block_input


def host_train_need(
    shape: ModelShape,
    knobs: Knobs,
    checkpoint_bytes: int,
    targets: Targets = DEFAULT_TARGETS,
    largest_shard_bytes: int | None = None,
) -> HostTrainNeed:
    """The host RAM of training ``shape`` with ``knobs``; ``largest_shard_bytes``: the checkpoint's
    largest file (None or 0: not known, the whole of it)."""
    components = {
        "resident": TRAIN_RESIDENT_RSS,
        "offloaded_activations": offloaded_bytes(shape, knobs, targets),
        "paged_optimizer_state": adapter_bytes(shape, knobs, targets).paged,
        "data_loader": BATCH_TENSORS * pinned(knobs.micro_batch_size * knobs.max_seq_len * INT64),
    }
    basis = (
        f"training: {TRAIN_RESIDENT_RSS / 1e9:.2f} GB resident (H200, 7B/8B children) + offloaded "
        "activations (one micro-step's, in reused pinned buffers, each rounded up to a power of two) + paged "
        "optimizer state (may page to the host) + the data loader's pinned batch; the need is the larger of "
        "that and the load's: imports + the largest shard in the page cache (the load's RSS peak is the "
        "checkpoint's file-backed pages, which the kernel reclaims: H200, 8B, 15.3 of 16.0 GiB)"
    )
    load_need = IMPORTS_RSS + (largest_shard_bytes or checkpoint_bytes)
    terms = {k: v for k, v in components.items() if v}
    return HostTrainNeed(host_need(checkpoint_bytes).load_peak, terms, basis, load_need)
