"""Host memory: loading a checkpoint into 4-bit, merging the adapter, and CPU-side training.

The basis is measured, not derived: safetensors maps the checkpoint file, so every page of the
16-bit checkpoint passes through the loading process's resident set (and the cgroup's page
cache) on its way to the GPU, on top of what the imports cost. On the H200 host a 7B
checkpoint (13.5 GB in bf16) peaked at 14.6 GB RSS while loading into 4-bit; the grid in
bench/results/memory-grid-h200-*/ records the peak RSS of every shape and fits
:data:`LOAD_PER_CHECKPOINT_BYTE` and :data:`IMPORTS_RSS`.
"""

from __future__ import annotations

from dataclasses import dataclass

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
