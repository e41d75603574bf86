"""FSDP-QLoRA (``Knobs.fsdp``, ``resources.parallel: fsdp``): the ranks shard one 4-bit model. Read
against transformers 5.25, accelerate 1.16, peft 0.21, bitsandbytes 0.50:

* **Storage dtype**: ``bnb_4bit_quant_storage`` is the compute dtype, so the packed 4-bit codes shard
  like any bf16 tensor; the Trainer sets FSDP's mixed precision to it (``update_fsdp_plugin_peft``).
* **No fp32 upcast**: the k-bit prepare leaves norms, embeddings and head in the compute dtype.
* **The wrap**: FSDP2, units per decoder block (``_no_split_modules``), LoRA (``fsdp_auto_wrap_policy``).
* **The load**: bitsandbytes quantizes on the card: each rank loads the whole 4-bit model on its GPU
  (``cuda:LOCAL_RANK``), then the Trainer shards it (``cpu_ram_efficient_loading`` skips 4-bit models).
* **GPUs only**: accelerate never turns ``MULTI_CPU`` into ``FSDP``, so CPU ranks would quietly run
  DDP: the child refuses. torch's FSDP2 itself runs on gloo CPU ranks (tests/test_fsdp_ranks.py)."""

from __future__ import annotations

from typing import Any

import torch

from qlora_supervise.trainer_child.contract.spec import Knobs
from qlora_supervise.trainer_child.run.failure import ConfigError


def storage(knobs: Knobs, dtype: torch.dtype) -> dict[str, Any]:
    """The quantization config's storage dtype under FSDP (bitsandbytes' uint8 otherwise)."""
    return {"bnb_4bit_quant_storage": dtype} if knobs.fsdp else {}


def kept_16bit(model: Any, knobs: Knobs) -> list[torch.nn.Parameter]:
    """Under FSDP, every parameter that is not 4-bit: each keeps the compute dtype through the k-bit
    prepare (FSDP's mixed precision casts them all to one)."""
    return [p for p in model.parameters() if type(p).__name__ != "Params4bit"] if knobs.fsdp else []


def block_classes(model: Any) -> list[str]:
    if not (names := getattr(model, "_no_split_modules", None) or []):
        raise ConfigError(f"{type(model).__name__} names no decoder block (_no_split_modules) to shard by")
    return list(names)


def refuse_cpu(knobs: Knobs, on_cuda: bool) -> None:
    if knobs.fsdp and not on_cuda:
        raise ConfigError(
            "resources.parallel: fsdp needs GPUs: accelerate runs CPU ranks as DDP only "
            "(set parallel: ddp, or run on GPUs)"
        )


def trainer_args(knobs: Knobs, model: Any) -> dict[str, Any]:
    """The SFTConfig arguments that turn FSDP on ({} for DDP or one process)."""
    if not knobs.fsdp:
        return {}
    return {
        "fsdp": True,
        "fsdp_config": {
            "version": 2,
            "auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "transformer_layer_cls_to_wrap": block_classes(model),
            "reshard_after_forward": True,
            "cpu_ram_efficient_loading": False,
            "state_dict_type": "FULL_STATE_DICT",  # the checkpoint's adapter stays one file, as on one card
        },
    }
