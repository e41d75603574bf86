"""FSDP-QLoRA (``Knobs.fsdp``, ``resources.parallel: fsdp``): the ranks shard one 4-bit model.

Read against the installed stack (transformers 5.25, accelerate 1.16, peft 0.21, bitsandbytes 0.50):

* **Storage dtype.** ``bnb_4bit_quant_storage`` set to the compute dtype: the packed 4-bit codes are
  the same bytes viewed as bf16, a dtype FSDP shards like any other; transformers' Trainer then sets
  FSDP's mixed precision to it (``distributed/fsdp.py``, ``update_fsdp_plugin_peft``).
* **No fp32 upcast.** ``prepare_model_for_kbit_training`` would cast the norms, embeddings and head to
  fp32; they keep the compute dtype (the k-bit prepare still enables checkpointing and input grads).
* **The wrap.** FSDP2 (transformers' default version), one unit per decoder block
  (``TRANSFORMER_BASED_WRAP`` on the model's ``_no_split_modules``); the Trainer swaps in peft's
  ``fsdp_auto_wrap_policy`` for a PeftModel, which also gives each LoRA layer a unit of its own.
* **The load.** bitsandbytes quantizes on the card, so transformers' 4-bit quantizer places the whole
  model on ``cuda:LOCAL_RANK`` (``update_device_map``) before the Trainer shards it: the load holds
  the whole 4-bit model on every card (the memory model's ``load`` phase), training holds a shard.
  ``cpu_ram_efficient_loading`` (rank 0 loads, the others get meta tensors) applies only to models
  that are not quantized in transformers 5 (``modeling_utils``: ``not is_quantized``), so it is off.
* **GPUs only.** accelerate makes FSDP a distributed type only on GPU-like devices
  (``accelerate/state.py``: ``MULTI_CPU`` is never turned into ``FSDP``), so CPU ranks would quietly
  run DDP: the child refuses instead. torch's own FSDP2 does run on gloo CPU ranks, which is how
  tests/test_fsdp_ranks.py checks this module's model sharded and trained.
"""

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
    prepare (one dtype for every parameter of the model, as FSDP's mixed precision casts them)."""
    if not knobs.fsdp:
        return []
    return [p for p in model.parameters() if type(p).__name__ != "Params4bit"]


def block_classes(model: Any) -> list[str]:
    """The decoder block classes FSDP wraps one unit each (transformers' own ``_no_split_modules``)."""
    names = getattr(model, "_no_split_modules", None) or []
    if not names:
        raise ConfigError(f"{type(model).__name__} names no decoder block (_no_split_modules) to shard by")
    return list(names)


def refuse_cpu(knobs: Knobs, on_cuda: bool) -> None:
    """Before the load: FSDP on CPU ranks would quietly be DDP (see the module's docstring)."""
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
