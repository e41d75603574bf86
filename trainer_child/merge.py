"""``python -m qlora_supervise.trainer_child.merge --spec attempt.json``: merge the adapter.

A separate process from training, so it starts with nothing else in memory: the base model is
loaded in the training compute dtype (not 4-bit: merging into quantized weights would round
the adapter away), the adapter from ``spec.adapter_dir`` is merged and the result saved to
``spec.merged_dir`` through a temp dir and a rename. On the CPU when ``Knobs.merge_on_cpu``.
Errors use the same report and exit codes as training, with stage ``merge``.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

from .attempt import Context, guarded
from .protocol import AttemptSpec, DeviceError, ExitCode, Stage


def merge_dtype(name: str, on_gpu: bool) -> object:
    """The training compute dtype; ``auto`` off the GPU means bf16 (not the fp32 of CPU
    training), because a CPU merge is usually of a GPU-trained model and fp32 would double it."""
    import torch

    from .recipe import compute_dtype

    if name == "auto" and not on_gpu:
        return torch.bfloat16
    return compute_dtype(name, on_gpu)


def merge(ctx: Context) -> ExitCode:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import checkpoints
    from .durable import fsync_dir
    from .failure import ConfigError

    spec = ctx.spec
    adapter = Path(spec.adapter_dir)
    if not (adapter / "adapter_config.json").is_file():
        raise ConfigError(f"adapter_dir {adapter}: no adapter_config.json (has training finished?)")
    ctx.progress.enter(Stage.MERGE)
    on_gpu = ctx.on_cuda and not spec.knobs.merge_on_cpu
    dtype = merge_dtype(spec.train.compute_dtype, on_gpu)
    base = AutoModelForCausalLM.from_pretrained(
        spec.knobs.model,
        dtype=dtype,
        device_map={"": 0 if on_gpu else "cpu"},
        trust_remote_code=spec.train.trust_remote_code,
        low_cpu_mem_usage=True,
    )
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    target = Path(spec.merged_dir)
    temp = target.with_name(f".tmp-{target.name}-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    merged.save_pretrained(temp)
    AutoTokenizer.from_pretrained(str(adapter)).save_pretrained(temp)
    checkpoints.fsync_tree(temp)
    if target.exists():
        shutil.rmtree(target)
    os.rename(temp, target)
    fsync_dir(target.parent)
    del merged, base
    if on_gpu:
        torch.cuda.empty_cache()
    ctx.events.emit("finished", step=None, merged=str(target))
    return ExitCode.OK


def main(argv: list[str] | None = None) -> int:
    from .__main__ import parse_args, prepare_env, read_spec

    path = parse_args(argv, "python -m qlora_supervise.trainer_child.merge")
    try:
        spec: AttemptSpec = read_spec(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        print(f"cannot read attempt spec {path}: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG)
    if spec.knobs.merge_on_cpu:
        spec = _on_cpu(spec)
    try:
        prepare_env(spec)
    except DeviceError as exc:
        print(f"trainer child: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG)
    return guarded(spec, merge)


def _on_cpu(spec: AttemptSpec) -> AttemptSpec:
    """Hide the GPUs: a CPU merge must not even create a CUDA context on a full device."""
    import dataclasses

    return dataclasses.replace(spec, device="cpu", gpu_memory_limit=None)


if __name__ == "__main__":
    sys.exit(main())
