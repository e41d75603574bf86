"""The merge's memory plan, pure arithmetic on byte counts: on the GPU the base, the adapter, the
largest layer's ``B @ A`` and a CUDA reserve, plus host RAM for the imports and one input and output
shard; on the CPU all of it in host RAM. Users' first merge complaint is host RAM, so ``auto`` takes
the GPU only when both its numbers fit."""

from __future__ import annotations

from dataclasses import asdict, dataclass

#: RSS of a merge child after importing torch, transformers and peft (CPU build: less).
IMPORTS_BYTES = 1_200_000_000
CUDA_CONTEXT_BYTES = 600 * 2**20
#: Output shards of the merged model (safetensors): small enough that serialising one is cheap.
MAX_SHARD_BYTES = 2 * 10**9
#: A plan fits when it needs at most this share of what is free (the rest absorbs estimate error).
FIT_SHARE = 0.9


@dataclass(frozen=True)
class MergeSizes:
    weights: int  # the base model in the merge dtype
    adapter: int
    largest_layer: int  # bytes of the largest linear weight (its B @ A delta is this size)
    largest_shard: int  # the largest input file the loader maps at once


@dataclass(frozen=True)
class MergePlan:
    """The plan as ``merge_plan`` and ``merge.json`` write it (:meth:`fields`)."""

    device: str  # "cuda" or "cpu"
    gpu_need_bytes: int
    host_need_gpu_bytes: int  # host RAM when merging on the GPU
    host_need_cpu_bytes: int  # host RAM when merging on the CPU
    gpu_free_bytes: int | None
    host_available_bytes: int
    why: str

    def fields(self) -> dict[str, object]:
        return asdict(self)


def plan_merge(sizes: MergeSizes, requested: str, gpu_free: int | None, host_available: int) -> MergePlan:
    """The device to merge on: ``requested`` is auto, cpu or cuda; ``gpu_free`` None: no GPU."""
    out_shard = min(MAX_SHARD_BYTES, sizes.weights)
    gpu_need = sizes.weights + sizes.adapter + sizes.largest_layer + CUDA_CONTEXT_BYTES
    host_gpu = IMPORTS_BYTES + sizes.largest_shard + out_shard
    host_cpu = IMPORTS_BYTES + sizes.weights + sizes.adapter + sizes.largest_layer + out_shard
    fits_host_gpu = host_gpu <= host_available * FIT_SHARE
    fits_gpu = gpu_free is not None and gpu_need <= gpu_free * FIT_SHARE and fits_host_gpu

    def plan(device: str, why: str) -> MergePlan:
        return MergePlan(device, gpu_need, host_gpu, host_cpu, gpu_free, host_available, why)

    if requested == "cpu" or gpu_free is None:
        return plan("cpu", "asked for the CPU" if requested == "cpu" else "no GPU visible")
    if requested == "cuda":
        return plan("cuda", "asked for the GPU")
    if fits_gpu:
        return plan("cuda", "the model, the adapter and one layer's delta fit the free GPU memory")
    if gpu_need > gpu_free * FIT_SHARE:
        return plan("cpu", "the merge does not fit the free GPU memory; the CPU merge is slower, not worse")
    return plan("cpu", "host RAM is too small for shard-by-shard loading onto the GPU")
