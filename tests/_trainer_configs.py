"""Configs of foreign trainers for the tiny model, as their users would write them (tests only)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml
from _child import CAPPED_HEADROOM
from _machine import above_baseline


def text_dataset(tiny_dir: Path, out: Path) -> Path:
    """A dataset directory ``datasets.load_dataset(dir)`` reads: the tiny rows' ``text`` alone
    (trl would take a ``messages`` column as chat turns)."""
    directory = out / "dataset"
    directory.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in (tiny_dir / "data.jsonl").read_text().splitlines() if line.strip()]
    (directory / "train.jsonl").write_text("".join(json.dumps({"text": r["text"]}) + "\n" for r in rows))
    return directory


def trl_config(tiny_dir: Path, out: Path, **keys: Any) -> dict[str, Any]:
    """A trl sft config of the tiny model in 4-bit with LoRA on the attention projections: at
    micro-batch 16, seq 256 and no checkpointing it needs ~1.4 GiB of data segment, at micro-batch
    8 ~1.0 GiB, so the capped job's cap (``CAPPED_HEADROOM`` above the import baseline) sits between."""
    return {
        "model_name_or_path": str(tiny_dir / "model"),
        "dataset_name": str(text_dataset(tiny_dir, out)),
        "use_peft": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        "load_in_4bit": True,
        "per_device_train_batch_size": 16,
        "gradient_accumulation_steps": 1,
        "gradient_checkpointing": False,
        "max_length": 256,
        "optim": "adamw_torch",
        "learning_rate": 2.0e-4,
        "max_steps": 3,
        "save_steps": 1,
        "logging_steps": 1,
        "report_to": "none",
        "bf16": False,  # the CPU: trl would ask for bf16 on a GPU
        "output_dir": "./sft-out",
        "seed": 42,
        "a_key_we_do_not_know": {"kept": [1, 2]},  # passed through untouched (trl ignores it)
        **keys,
    }


def trl_job(
    tiny_dir: Path, out: Path, *, capped: bool = True, supervise: dict[str, Any] | None = None, **keys: Any
) -> Path:
    """``out/job.yaml`` supervising ``trl sft`` with ``out/sft.yaml``; run dir ``out/run``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "sft.yaml").write_text(yaml.safe_dump(trl_config(tiny_dir, out, **keys), sort_keys=False))
    resources: dict[str, Any] = {"gpu": "cpu"}
    if capped:
        resources["cpu_memory_limit"] = f"{above_baseline(CAPPED_HEADROOM)}B"
    job = {
        "trainer": {"kind": "trl-sft", "config": "sft.yaml"},
        "resources": resources,
        "supervise": {
            "hang_timeout": "5m",
            "backoff_initial": "0.1s",
            "backoff_max": "1s",
            **(supervise or {}),
        },
        "output_dir": "./run",
    }
    (out / "job.yaml").write_text(yaml.safe_dump(job, sort_keys=False))
    return out / "job.yaml"


def axolotl_config(tiny_dir: Path, out: Path, **keys: Any) -> dict[str, Any]:
    """An axolotl QLoRA config of the tiny model: the same rows, shape and knobs as
    :func:`trl_config` (micro-batch 16 at seq 256, no checkpointing), in axolotl's keys."""
    rows = text_dataset(tiny_dir, out) / "train.jsonl"
    return {
        "base_model": str(tiny_dir / "model"),
        "datasets": [{"path": str(rows), "ds_type": "json", "type": "completion"}],
        "dataset_prepared_path": "./prepared",
        "adapter": "qlora",
        "load_in_4bit": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "lora_dropout": 0.05,
        "lora_target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"],
        # axolotl turns its Triton LoRA kernels on by itself; they need CUDA
        "lora_qkv_kernel": False,
        "lora_o_kernel": False,
        "lora_mlp_kernel": False,
        "sequence_len": 256,
        "excess_length_strategy": "truncate",  # the tiny rows are longer: axolotl drops them by default
        "micro_batch_size": 16,
        "gradient_accumulation_steps": 1,
        "gradient_checkpointing": False,
        "optimizer": "adamw_torch",
        "learning_rate": 2.0e-4,
        "lr_scheduler": "cosine",
        "max_steps": 3,
        "save_steps": 2,
        "logging_steps": 1,
        "seed": 42,
        "output_dir": "./axolotl-out",
        "a_key_we_do_not_know": {"kept": [1, 2]},  # passed through (axolotl warns and ignores it)
        **keys,
    }
