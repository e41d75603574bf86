"""LLaMA-Factory: ``python -m llamafactory.launcher <config>`` (what ``llamafactory-cli train`` runs)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.jobfile.bounds import json_loads
from qlora_supervise.supervisor.jobfile.problems import Problem, show
from qlora_supervise.supervisor.trainers import tool
from qlora_supervise.supervisor.trainers.mapping import lookup
from qlora_supervise.supervisor.trainers.tool import Config, Row, Table, Tool


def _4bit(value: Any) -> Any:
    # None: no quantization_bit, loaded unquantized (False); another type is left to the type check.
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value == 4
    return value


TABLE = Table(
    "llamafactory",
    rows=(
        Row("model", "model_name_or_path", None),
        Row("micro_batch_size", "per_device_train_batch_size", 8),
        Row("grad_accum", "gradient_accumulation_steps", 1),
        # LLaMA-Factory checkpoints unless told not to: the key is inverted.
        Row(
            "gradient_checkpointing",
            "disable_gradient_checkpointing",
            False,
            read=lambda v: not v if isinstance(v, bool) else v,
            write=lambda v: not v,
        ),
        Row("optimizer", "optim", "adamw_torch_fused"),  # transformers 5's TrainingArguments default
        Row("max_seq_len", "cutoff_len", 2048),
        Row("lora_r", "lora_rank", 8),
        # None: lora_rank * 2 (finetuning_args.py)
        Row("lora_alpha", "lora_alpha", lambda config: 2 * int(config.get("lora_rank") or 8)),
        Row("load_in_4bit", "quantization_bit", None, read=_4bit, write=lambda v: 4 if v else None),
        Row("quant_type", "quantization_type", "nf4"),
        Row("double_quant", "double_quantization", True),
        Row("eval_batch_size", "per_device_eval_batch_size", 8),
        tool.EVAL_STRATEGY,
    ),
    required={
        "model_name_or_path": "add model_name_or_path: a local model directory (the child runs offline)",
        "do_train": "add do_train: true",
    },
    contradictions=(
        *tool.restarts("per_device_train_batch_size", "gradient_accumulation_steps"),
        tool.lora_only("finetuning_type", ("lora",)),
        *tool.TRAINER_ARGUMENTS_CONTRADICTIONS,
    ),
    targets_key="lora_target",
    data_key="dataset",
)

#: ``flash_attn`` (extras/constants.py, AttentionFunction): "auto" is transformers' default.
_ATTENTION = {"disabled": "eager", "sdpa": "sdpa", "fa2": "sdpa", "fa3": "sdpa"}
_ADD = "add it to dataset_info.json, or name one of its datasets"
#: data/parser.py: its default folder, the file in it, and the folder values that name the hub.
_DIR, _INFO, _HUB = "data", "dataset_info.json", ("ONLINE", "REMOTE:")


def _attention(config: Config) -> str | None:
    value = lookup(config, "flash_attn")
    return _ATTENTION.get(value) if isinstance(value, str) else None


def _eight_bit(config: Config) -> str | None:
    bits = lookup(config, "quantization_bit")
    return f"quantization_bit: {bits}" if bits == 8 else None


def _unmodelled(config: Config, saved_4bit: bool) -> str | None:
    method = lookup(config, "quantization_method")
    bits = lookup(config, "quantization_bit")  # without a bit it loads unquantized
    if saved_4bit or not isinstance(bits, int) or not isinstance(method, str) or method == "bnb":
        return None
    counts = "the memory model counts bitsandbytes 4-bit QLoRA weights"
    return f"quantization_method: {method}: the tool quantizes on the fly with {method}; {counts}"


def _data_problems(config: Config, where: str, workdir: Path) -> list[Problem]:
    """Dataset names it looks up in ``dataset_dir/dataset_info.json`` (from the folder it runs in)."""
    tokenized = config.get("tokenized_path")
    if isinstance(tokenized, str) and (workdir / tokenized).is_dir():  # saved already: loaded from there
        return []
    names = [*_names(config.get("dataset")), *_names(config.get("eval_dataset"))]
    folder = config.get("dataset_dir", _DIR)
    if not names or not isinstance(folder, str) or folder.startswith(_HUB):
        return []
    info = workdir / folder / _INFO
    try:
        known = json_loads(info.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        why = (
            f"LLaMA-Factory looks up its datasets ({', '.join(names)}) in {info}, which it cannot read "
            f"({type(exc).__name__})"
        )
        fix = (
            "set dataset_dir to the folder that holds dataset_info.json (LLaMA-Factory's examples "
            "expect its repository's data/), or trainer.workdir to where you run llamafactory-cli"
        )
        return [Problem(f"{where}: dataset_dir", why, show(folder), fix)]
    missing = [name for name in names if not isinstance(known, dict) or name not in known]
    return [Problem(f"{where}: dataset", f"not defined in {info}", show(name), _ADD) for name in missing]


def _names(value: Any) -> list[str]:  # a comma-separated string, or a YAML list
    names = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else []
    return [str(name).strip() for name in names if str(name).strip()]


TOOL = Tool(
    TABLE,
    package="llamafactory",
    entry=("-m", "llamafactory.launcher"),
    targets_regex=False,  # its lora_target is comma-separated names, not a pattern
    all_linear_words=("all", "all-linear"),
    attention=_attention,
    eight_bit=_eight_bit,
    unmodelled=_unmodelled,
    data_problems=_data_problems,
)
