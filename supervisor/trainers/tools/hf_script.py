"""An HfArgumentParser script: the job's ``trainer.command``, its TrainingArguments flags changed. Its
own flags (model, sequence length, LoRA, 4-bit) apply only where the command has them."""

from __future__ import annotations

from typing import Any

from qlora_supervise.supervisor.trainers import tool
from qlora_supervise.supervisor.trainers.tool import Contradiction, Row, Table, Tool

#: HfArgumentParser's ``string_to_bool``: the words a bool flag takes (flags.parse leaves yes/no as words).
_ARGPARSE_BOOLS = {"yes": True, "y": True, "t": True, "no": False, "n": False, "f": False}


def _argparse_bool(value: Any) -> Any:
    """A bool flag's word or 0/1 as HfArgumentParser reads it; anything else for the type check."""
    if isinstance(value, str) and value.lower() in _ARGPARSE_BOOLS:
        return _ARGPARSE_BOOLS[value.lower()]
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    return value


TABLE = Table(
    "hf-script",
    rows=(
        Row("model", "model_name_or_path", None),
        Row("micro_batch_size", "per_device_train_batch_size", 8),
        Row("grad_accum", "gradient_accumulation_steps", 1),
        Row(
            "gradient_checkpointing",
            "gradient_checkpointing",
            False,
            read=_argparse_bool,
            preferred=tool.ACTIVATION_CHECKPOINTING,
        ),
        Row("optimizer", "optim", "adamw_torch_fused"),
        Row("eval_batch_size", "per_device_eval_batch_size", 8),
        tool.EVAL_STRATEGY,
        Row("max_seq_len", "max_seq_length", 512, present_only=True),
        Row("lora_r", "lora_r", 8, present_only=True),
        Row("lora_alpha", "lora_alpha", 16, present_only=True),
        Row("load_in_4bit", "load_in_4bit", False, read=_argparse_bool, present_only=True),
    ),
    required={"output_dir": "add --output_dir (TrainingArguments requires it; the supervisor replaces it)"},
    contradictions=(
        *tool.restarts("--per_device_train_batch_size", "--gradient_accumulation_steps"),
        *(tool.unquoted_no(key) for key in tool.STRATEGY_KEYS),
        Contradiction("deepspeed", tool.present, tool.MULTI_GPU, "delete --deepspeed"),
        Contradiction("fsdp", tool.present, tool.MULTI_GPU, "delete --fsdp"),
    ),
)

TOOL = Tool(
    TABLE,
    unquantized=(
        "the script's command has no --load_in_4bit true, so how it loads the base model is its "
        "own; the memory model counts 4-bit weights"
    ),
)
