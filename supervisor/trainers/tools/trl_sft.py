"""``trl sft``: trl's SFT script on a YAML config, started as ``python -m trl.scripts.sft``."""

from __future__ import annotations

from qlora_supervise.supervisor.trainers import tool
from qlora_supervise.supervisor.trainers.tool import Config, Contradiction, Row, Table, Tool

TABLE = Table(
    "trl-sft",
    rows=(
        Row("model", "model_name_or_path", None),
        Row("micro_batch_size", "per_device_train_batch_size", 8),
        Row("grad_accum", "gradient_accumulation_steps", 1),
        Row(
            "gradient_checkpointing", "gradient_checkpointing", True, preferred=tool.ACTIVATION_CHECKPOINTING
        ),
        Row("optimizer", "optim", "adamw_torch_fused"),
        Row("max_seq_len", "max_length", 1024),
        Row("lora_r", "lora_r", 16),
        Row("lora_alpha", "lora_alpha", 32),
        Row("load_in_4bit", "load_in_4bit", False),
        Row("quant_type", "bnb_4bit_quant_type", "nf4"),
        Row("double_quant", "use_bnb_nested_quant", False),
        Row("eval_batch_size", "per_device_eval_batch_size", 8),
        tool.EVAL_STRATEGY,
    ),
    required={
        "model_name_or_path": "add model_name_or_path: a local model directory (the child runs offline)",
        "use_peft": "add use_peft: true: the supervisor supervises LoRA / QLoRA fine-tunes",
    },
    # trl's parser drops unknown keys in silence: these older names (trl 0.20, transformers 5) too.
    renamed={"max_seq_length": "max_length", "torch_dtype": "dtype", "evaluation_strategy": "eval_strategy"},
    reads_quoted_numbers=True,
    contradictions=(
        *tool.restarts("per_device_train_batch_size", "gradient_accumulation_steps"),
        Contradiction("use_peft", lambda v: v is not True, "not a LoRA fine-tune", "set use_peft: true"),
        *tool.TRAINER_ARGUMENTS_CONTRADICTIONS,
        # Keys `trl sft` hands to `accelerate launch`: the supervisor's one process would drop them.
        Contradiction(
            "accelerate_config",
            tool.present,
            "an argument of trl's `accelerate launch`: the supervisor starts one process without it",
            "delete accelerate_config (one process on the job's GPU; DeepSpeed, FSDP: not supervised yet)",
        ),
        Contradiction("num_processes", lambda v: v not in (None, 1), tool.MULTI_GPU, "delete num_processes"),
        Contradiction("num_machines", lambda v: v not in (None, 1), tool.MULTI_GPU, "delete num_machines"),
        *(
            Contradiction(key, tool.is_true, tool.MULTI_GPU, f"delete {key}")
            for key in ("multi_gpu", "use_deepspeed", "use_fsdp")
        ),
    ),
)

#: accelerate launch's arguments a trl config may carry (not fields of trl's dataclasses).
LAUNCH_KEYS = ("accelerate_config", "num_processes", "num_machines", "multi_gpu", "use_deepspeed", "use_fsdp")


def _unmodelled(config: Config, saved_4bit: bool) -> str | None:
    if "max_length" in config and config["max_length"] is None:
        return (
            "max_length: null: trl does not truncate, so a step's memory follows the longest sample; "
            "set max_length to a number for a prediction"
        )
    return None


TOOL = Tool(
    TABLE,
    package="trl",
    # Its own entry module in one process (``trl sft`` itself would go through accelerate launch).
    entry=("-m", "trl.scripts.sft", "--config"),
    one_name_list_is_name=True,  # ModelConfig.__post_init__ turns [q_proj] into "q_proj"
    peft_default_targets=True,  # trl hands peft None: peft's default for the model type
    unmodelled=_unmodelled,
    head_dtype_key="dtype",  # trl 1.16 skips prepare_model_for_kbit_training: model_facts.keeps_head_dtype
)
