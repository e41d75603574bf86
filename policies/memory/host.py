"""Host memory: loading a checkpoint into 4-bit, merging the adapter, and training (the host's budget).

The basis is measured, not derived: safetensors maps the checkpoint file, so every page of the
16-bit checkpoint passes through the loading process's resident set (and the cgroup's page
cache) on its way to the GPU, on top of what the imports cost. On the H200 host a 7B
checkpoint (13.5 GB in bf16) peaked at 14.6 GB RSS while loading into 4-bit; the grid in
bench/results/memory-grid-h200-*/ records the peak RSS of every shape and fits
:data:`LOAD_PER_CHECKPOINT_BYTE` and :data:`IMPORTS_RSS`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from qlora_supervise.policies.memory.gpu import DEFAULT_TARGETS, FP32, layer_activation_bytes
from qlora_supervise.policies.memory.optimizer import adapter_bytes
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.trainer_child.contract.spec import Knobs

#: RSS of the child after importing torch (CUDA build), transformers, peft, trl, bitsandbytes.
IMPORTS_RSS = 1_600_000_000
#: The same imports with torch's CPU build (no CUDA libraries): 0.50 GB peak RSS measured on the
#: 2-core CPU host (torch 2.13 CPU, transformers, peft, trl, datasets, accelerate, bitsandbytes).
CPU_IMPORTS_RSS = 500_000_000
#: Peak RSS while loading, per byte of the 16-bit checkpoint (mapped pages + conversion buffers).
LOAD_PER_CHECKPOINT_BYTE = 0.97
#: A merge loads the base in 16-bit on the CPU (the checkpoint once), adds the adapter, and
#: writes the merged shards (one shard's serialisation buffer at a time).
MERGE_PER_CHECKPOINT_BYTE = 1.05
#: Data segment of the child after the imports on a CPU build (trainer_child/stack.py).
CPU_BUILD_VMDATA = 430_000_000


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
        f"imports {imports / 1e9:.1f} GB{build} + {LOAD_PER_CHECKPOINT_BYTE:.2f} x the 16-bit checkpoint "
        "to load "
        f"(measured on the H200 host: 7B, 13.5 GB checkpoint, 14.6 GB peak RSS); merge: "
        f"{MERGE_PER_CHECKPOINT_BYTE:.2f} x checkpoint + one shard being written"
    )
    return HostNeed(load, merge, basis)


# ---- training --------------------------------------------------------------------------------
#
# What the child holds on the host while it trains, once the load is over (safetensors' mapped
# pages are gone by then: the 7B and 8B children of bench/results/recovery-h200-2026-12-01 fell
# from 12-15 GB RSS while loading to 1.2 GB once loaded):
#
# * the resident set of a training child: the imports, the CUDA context's host side (driver,
#   cuBLAS and kernel images), the tokenized data set, autograd's and the optimizer's bookkeeping
#   (:data:`TRAIN_RESIDENT_RSS`; 2.03-2.19 GB over every 7B and 8B run there, independent of the
#   model's size: the weights live on the card);
# * activation offload (trainer_child/recipe/activations.py): what the forward saves for backward,
#   in host buffers reused between micro-steps, so one micro-step's worth. With checkpointing
#   that is each block's fp32 input; without it every activation of every block. Pinned buffers
#   come from the host caching allocator, which rounds each up to a power of two;
# * the paged optimizer's state (CUDA unified memory): it stays on the card until the card runs
#   short, and then pages to the host, so the host must be able to take it;
# * the data loader's pinned batch (input ids, attention mask and labels, int64).

#: RSS of a training child besides offloaded activations (H200, torch 2.11, 7B and 8B, see above).
TRAIN_RESIDENT_RSS = 2_150_000_000
#: The int64 tensors of a collated batch the data loader pins (input ids, attention mask, labels).
BATCH_TENSORS = 3
INT64 = 8


@dataclass(frozen=True)
class HostTrainNeed:
    """Host RAM one training config needs (bytes): the load's peak RSS (``load_peak``, as measured),
    what of the load the host must hold (``load_need``), the training phase's by component, and the
    larger of the last two (``peak_bytes``, what the host budget must hold).

    The load's RSS peak is almost all the checkpoint's pages mapped from its files (safetensors):
    on the H200 the 8B's 16.01 GiB peak was 15.28 GiB of file-backed pages and 0.62 GiB anonymous,
    the 4B's 8.55 GiB 7.85 and 0.62 (bench/results/host-memory-h200-2026-12-04/). Clean file pages
    are what the kernel drops first under pressure, and reads again: they never bring the OOM
    killer. So the load needs the imports and the shard being read in the page cache
    (:data:`IMPORTS_RSS` + the largest shard; the whole checkpoint when its shards are not known),
    not the whole checkpoint. What training holds is anonymous, and pinned buffers cannot even be
    swapped: that is the budget's.
    """

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


def residual_bytes(shape: ModelShape, knobs: Knobs) -> int:
    """Bytes per value of the residual stream, what a checkpointed block's input is saved in: fp32,
    except a family whose norms keep their input's dtype (Gemma) with the bf16 embeddings."""
    keeps = shape.block is not None and shape.block.norm_keeps_dtype
    return 2 if keeps and knobs.bf16_head else FP32


def offloaded_bytes(
    shape: ModelShape, knobs: Knobs, targets: tuple[str, ...] | str = DEFAULT_TARGETS, pin: bool = True
) -> int:
    """Host bytes activation offload holds at the end of one micro-step's forward (0 when off).

    With checkpointing each block's input (one ``tokens x hidden`` tensor a block, in the residual
    stream's dtype: :func:`residual_bytes`); without it
    every block's saved activations, rounded as its hidden-wide tensors are. Outside the blocks:
    the final norm's fp32 input and the fused head's gathered fp32 hidden states.
    """
    if not knobs.activation_offload:
        return 0
    tokens = knobs.micro_batch_size * knobs.max_seq_len
    hidden = tokens * shape.hidden * residual_bytes(shape, knobs)
    block_input = pinned(hidden) if pin else hidden
    if knobs.gradient_checkpointing:
        blocks = shape.layers * block_input
    else:
        per_layer = layer_activation_bytes(shape, knobs.lora_r, targets, 2, knobs.max_seq_len) * tokens
        blocks = int(shape.layers * per_layer * block_input / hidden)
    return blocks + 2 * block_input


def host_train_need(
    shape: ModelShape,
    knobs: Knobs,
    checkpoint_bytes: int,
    targets: tuple[str, ...] | str = DEFAULT_TARGETS,
    largest_shard_bytes: int | None = None,
) -> HostTrainNeed:
    """The host RAM of training ``shape`` with ``knobs`` (see the comment above the constants);
    ``largest_shard_bytes``: the checkpoint's largest file (None or 0: not known, the whole of it)."""
    batch = knobs.micro_batch_size * knobs.max_seq_len * INT64
    components = {
        "resident": TRAIN_RESIDENT_RSS,
        "offloaded_activations": offloaded_bytes(shape, knobs, targets),
        "paged_optimizer_state": adapter_bytes(shape, knobs, targets).paged,
        "data_loader": BATCH_TENSORS * pinned(batch),
    }
    basis = (
        f"training: {TRAIN_RESIDENT_RSS / 1e9:.2f} GB resident (H200, 7B/8B children) + offloaded "
        "activations (one micro-step's, in reused pinned buffers, each rounded up to a power of two) "
        "+ paged optimizer state (may page to the host) + the data loader's pinned batch; the need is "
        "the larger of that and the load's: imports + the largest shard in the page cache (the load's "
        "RSS peak is the checkpoint's file-backed pages, which the kernel reclaims: H200, 8B, 15.3 of "
        "16.0 GiB)"
    )
    load_need = IMPORTS_RSS + (largest_shard_bytes or checkpoint_bytes)
    terms = {k: v for k, v in components.items() if v}
    return HostTrainNeed(host_need(checkpoint_bytes).load_peak, terms, basis, load_need)
