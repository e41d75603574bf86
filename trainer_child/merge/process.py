"""``python -m qlora_supervise.trainer_child.merge.process --spec attempt.json``: merge the adapter
in a process of its own: the memory plan, a fresh base load in the *training* compute dtype (4-bit
would round the adapter away), the merge, and a sharded save through a temp dir and a rename, with
``merge.json`` inside. Errors use the child's report and exit codes, with stage ``merge``. The memory
plan (:func:`plan_merge`) is arithmetic on byte counts; users' first merge complaint is host RAM, so
``auto`` takes the GPU only when both its numbers (GPU memory and host RAM) fit."""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import sys
import time
from pathlib import Path
from typing import Any

from qlora_supervise.trainer_child.contract import checkpoints, processes
from qlora_supervise.trainer_child.contract.codes import ExitCode, Stage
from qlora_supervise.trainer_child.contract.events import Loaded, read_events
from qlora_supervise.trainer_child.contract.spec import DeviceError
from qlora_supervise.trainer_child.run.attempt import Context, guarded

#: ``qlora-supervise merge --device`` reaches the child through this variable (the spec's device
#: names *which* GPU; this says whether to use it).
DEVICE_ENV = "QLORA_SUPERVISE_MERGE_DEVICE"
#: RSS of a merge child after importing torch, transformers and peft (CPU build: less).
IMPORTS_BYTES = 1_200_000_000
CUDA_CONTEXT_BYTES = 600 * 2**20
#: Output shards of the merged model (safetensors): small enough that serialising one is cheap.
MAX_SHARD_BYTES = 2 * 10**9
#: A plan fits when it needs at most this share of what is free (the rest absorbs estimate error).
FIT_SHARE = 0.9


@dataclasses.dataclass(frozen=True)
class MergeSizes:
    weights: int  # the base model in the merge dtype
    adapter: int
    largest_layer: int  # bytes of the largest linear weight (its B @ A delta is this size)
    largest_shard: int  # the largest input file the loader maps at once


@dataclasses.dataclass(frozen=True)
class MergePlan:
    """The plan as ``merge_plan`` and ``merge.json`` write it."""

    device: str  # "cuda" or "cpu"
    gpu_need_bytes: int
    host_need_gpu_bytes: int  # host RAM when merging on the GPU
    host_need_cpu_bytes: int  # host RAM when merging on the CPU
    gpu_free_bytes: int | None
    host_available_bytes: int
    why: str


def plan_merge(sizes: MergeSizes, requested: str, gpu_free: int | None, host_available: int) -> MergePlan:
    """The device to merge on: ``requested`` is auto, cpu or cuda; ``gpu_free`` None: no GPU."""
    out_shard = min(MAX_SHARD_BYTES, sizes.weights)
    gpu_need = sizes.weights + sizes.adapter + sizes.largest_layer + CUDA_CONTEXT_BYTES
    host_gpu = IMPORTS_BYTES + sizes.largest_shard + out_shard
    host_cpu = IMPORTS_BYTES + sizes.weights + sizes.adapter + sizes.largest_layer + out_shard

    def plan(device: str, why: str) -> MergePlan:
        return MergePlan(device, gpu_need, host_gpu, host_cpu, gpu_free, host_available, why)

    if requested == "cpu" or gpu_free is None:
        return plan("cpu", "asked for the CPU" if requested == "cpu" else "no GPU visible")
    if requested == "cuda":
        return plan("cuda", "asked for the GPU")
    if gpu_need > gpu_free * FIT_SHARE:
        return plan("cpu", "the merge does not fit the free GPU memory; the CPU merge is slower, not worse")
    if host_gpu > host_available * FIT_SHARE:
        return plan("cpu", "host RAM is too small for shard-by-shard loading onto the GPU")
    return plan("cuda", "the model, the adapter and one layer's delta fit the free GPU memory")


def merge_dtype(name: str, on_gpu: bool, trained: str | None = None) -> Any:
    """The dtype training computed in: the job's, else the recorded one, else bf16 off the GPU."""
    import torch

    from qlora_supervise.trainer_child.recipe.qlora import compute_dtype

    recorded = (trained or "").removeprefix("torch.")
    if name == "auto" and recorded and hasattr(torch, recorded):
        return getattr(torch, recorded)
    return torch.bfloat16 if name == "auto" and not on_gpu else compute_dtype(name, on_gpu)


def trained_dtype(run_dir: Path) -> str | None:
    """The dtype the newest training attempt loaded in (its ``loaded`` event), if recorded."""
    for path in sorted(run_dir.glob("attempt-[0-9][0-9][0-9]/child-events.jsonl"), reverse=True):
        if dtypes := [e.dtype for e in read_events(path) if isinstance(e, Loaded) and e.dtype is not None]:
            return dtypes[-1]
    return None


def measure_sizes(model: str, adapter: Path, dtype: Any, trust_remote_code: bool) -> MergeSizes:
    """Sizes from the config on the meta device (no weights read) and the files on disk."""
    import torch
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code)
    with init_empty_weights():
        # transformers leaves from_config unannotated (untyped_calls_exclude does not reach it).
        empty = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)  # type: ignore[no-untyped-call]
    size = torch.empty((), dtype=dtype).element_size()
    weights = sum(p.numel() for p in empty.parameters()) * size
    layer = max((m.weight.numel() for m in empty.modules() if isinstance(m, torch.nn.Linear)), default=0)
    shards = [p.stat().st_size for p in Path(model).glob("*.safetensors")] if Path(model).is_dir() else []
    adapter_bytes = sum(p.stat().st_size for p in adapter.glob("*.safetensors"))
    return MergeSizes(weights, adapter_bytes, layer * size, max(shards, default=weights))


def _host_available() -> int:
    import psutil

    available = int(psutil.virtual_memory().available)
    try:
        text = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
    except (OSError, ValueError):
        return available
    return min(available, int(text) - used) if text.isdigit() else available


def merge(ctx: Context) -> ExitCode:
    # The module docstring's steps, together: the memory-relevant order reads in one place.
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from qlora_supervise.trainer_child.run.failure import ConfigError

    spec, started = ctx.spec, time.monotonic()
    adapter = Path(spec.adapter_dir)
    if not (adapter / "adapter_config.json").is_file():
        raise ConfigError(f"adapter_dir {adapter}: no adapter_config.json (has training finished?)")
    ctx.progress.enter(Stage.MERGE)
    trained = trained_dtype(Path(spec.run_dir))
    dtype = merge_dtype(spec.train.compute_dtype, ctx.on_cuda, trained)
    model, remote = spec.knobs.model, spec.train.trust_remote_code
    sizes = measure_sizes(model, adapter, dtype, remote)
    gpu_free = torch.cuda.mem_get_info()[0] if ctx.on_cuda else None
    if gpu_free is not None and spec.gpu_memory_limit is not None:
        gpu_free = min(gpu_free, spec.gpu_memory_limit)
    requested = "cpu" if spec.knobs.merge_on_cpu else os.environ.get(DEVICE_ENV, "auto")
    plan = plan_merge(sizes, requested, gpu_free, _host_available())
    on_gpu = plan.device == "cuda"
    ctx.events.emit("merge_plan", **dataclasses.asdict(plan), dtype=str(dtype))
    where = {"": 0 if on_gpu else "cpu"}
    base = AutoModelForCausalLM.from_pretrained(
        model, dtype=dtype, device_map=where, trust_remote_code=remote, low_cpu_mem_usage=True
    )
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    # Every floating-point weight in the training dtype (no fp32 delta in a bf16 base).
    wrong = sorted({str(p.dtype) for p in merged.parameters() if p.is_floating_point() and p.dtype != dtype})
    if wrong:
        raise RuntimeError(f"merged weights in {wrong}, expected {dtype} (the training compute dtype)")
    target = Path(spec.merged_dir)
    temp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    merged.save_pretrained(temp, max_shard_size=MAX_SHARD_BYTES)  # safetensors: transformers 5's only format
    AutoTokenizer.from_pretrained(str(adapter)).save_pretrained(temp)
    report = {
        "seconds": round(time.monotonic() - started, 1),
        "device": plan.device,
        "dtype": str(dtype).removeprefix("torch."),
        "trained_dtype": trained,
        "gpu_peak_bytes": int(torch.cuda.max_memory_allocated()) if on_gpu else None,
        "host_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # KiB on Linux
        "shards": sorted(p.name for p in temp.glob("*.safetensors")),
        "plan": dataclasses.asdict(plan),
    }
    (temp / "merge.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    checkpoints.replace_dir(temp, target)  # 0750 / 0640 whatever the umask; a link is not followed
    del merged, base
    ctx.events.emit("finished", step=None, merged=str(target), seconds=report["seconds"], device=plan.device)
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    from qlora_supervise.trainer_child.__main__ import parse_args, prepare_env, spec_or_none

    if (spec := spec_or_none(parse_args(argv, f"python -m {processes.MERGE}"))) is None:
        return int(ExitCode.CONFIG)
    if spec.knobs.merge_on_cpu or os.environ.get(DEVICE_ENV) == "cpu":
        # Hide the GPUs: a CPU merge must not even create a CUDA context on a full device.
        spec = dataclasses.replace(spec, device="cpu", gpu_memory_limit=None)
    try:
        prepare_env(spec)
    except DeviceError as exc:
        print(f"trainer child: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG)
    return guarded(spec, merge)


if __name__ == "__main__":
    sys.exit(main())
