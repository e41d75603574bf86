"""A script with its settings in its code (``trainer.kind: script``), run as written: the shim changes
the knobs where the script builds them, under the keys below; attempt 1 changes nothing and reports
what the script built."""

from __future__ import annotations

from pathlib import Path

from qlora_supervise.supervisor.jobfile.problems import Problem, show
from qlora_supervise.supervisor.trainers.tool import EVAL_STRATEGY, Row, Table, Tool

#: The keys as the shim finds them; the defaults (TrainingArguments', trl's, peft's) stand until
#: attempt 1 reports what the script built.
TABLE = Table(
    "script",
    rows=(
        Row("micro_batch_size", "per_device_train_batch_size", 8),
        Row("grad_accum", "gradient_accumulation_steps", 1),
        Row("gradient_checkpointing", "gradient_checkpointing", False),
        Row("optimizer", "optim", "adamw_torch_fused"),
        Row("eval_batch_size", "per_device_eval_batch_size", 8),
        EVAL_STRATEGY,
        Row("max_seq_len", "max_length", 1024),
        Row("lora_r", "r", 8),
        Row("lora_alpha", "lora_alpha", 8),
        Row("quant_type", "bnb_4bit_quant_type", "fp4"),
        Row("double_quant", "bnb_4bit_use_double_quant", False),
        # Not a key of the script: the shim's change at prepare_model_for_kbit_training.
        Row("bf16_head", "bf16_head", False),
    ),
)


def script_problems(command: tuple[str, ...], workdir: Path) -> list[Problem]:
    """The command must run a Python file that is there: ``[python, train.py, ...]``."""
    fix = f"write [python, train.py, ...] with the script's path relative to {workdir}, or absolute"
    if (script := next((word for word in command[1:] if word.endswith(".py")), None)) is None:
        return [Problem("trainer.command", "names no .py script to run", show(list(command)), fix)]
    if not (path := workdir / script).is_file():
        why = f"no such script (looked for {path}: it runs in trainer.workdir, else the job file's folder)"
        return [Problem("trainer.command", why, show(script), fix)]
    return []


TOOL = Tool(
    TABLE,
    settings_in_code=True,
    shim_rungs=frozenset({"bf16_head", "smaller_model"}),
    command_problems=script_problems,
    unquantized=(
        "the script's model and its quantization are read from its first attempt; until then the "
        "memory model has no model to count"
    ),
)
