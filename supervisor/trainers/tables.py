"""The knob -> key table of each tool, the keys that contradict the ladder, and the rungs each can take.

One row per knob the ladder may change: the tool's key (a dotted path for a nested one), the
tool's own default when the key is absent (``tests/test_trainer_tables.py`` checks them against
the tool's dataclasses or schema), and how a value reads and writes where the tool spells it
differently (LLaMA-Factory's ``quantization_bit: 4`` for 4-bit, its inverted
``disable_gradient_checkpointing``). A knob without a row cannot be changed for that tool, so the
rungs that change it are left out of its ladders (:data:`RUNGS`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qlora_supervise.policies.rungs import RUNGS
from qlora_supervise.supervisor.trainers.table_rows import (
    ACTIVATION_CHECKPOINTING,
    EVAL_STRATEGY,
    MULTI_GPU,
    STRATEGY_KEYS,
    TRAINER_ARGUMENTS_CONTRADICTIONS,
    Contradiction,
    Row,
    Table,
    TrainerKind,
    auto_batch,
    is_true,
    no_saves,
    present,
    resume,
    unquoted_no,
    writable,
)

# The row types are this module's too: the rest of the package imports tables from here.
__all__ = [
    "AXOLOTL",
    "HF_SCRIPT",
    "LLAMAFACTORY",
    "RUNG_KNOBS",
    "TABLES",
    "TRL_LAUNCH_KEYS",
    "TRL_SFT",
    "Contradiction",
    "Row",
    "Table",
    "TrainerKind",
    "rungs_for",
    "writable",
]

TRL_SFT = Table(
    TrainerKind.TRL_SFT,
    rows=(
        Row("model", "model_name_or_path", None),
        Row("micro_batch_size", "per_device_train_batch_size", 8),
        Row("grad_accum", "gradient_accumulation_steps", 1),
        Row("gradient_checkpointing", "gradient_checkpointing", True, preferred=ACTIVATION_CHECKPOINTING),
        Row("optimizer", "optim", "adamw_torch_fused"),
        Row("max_seq_len", "max_length", 1024),
        Row("lora_r", "lora_r", 16),
        Row("lora_alpha", "lora_alpha", 32),
        Row("load_in_4bit", "load_in_4bit", False),
        Row("quant_type", "bnb_4bit_quant_type", "nf4"),
        Row("double_quant", "use_bnb_nested_quant", False),
        Row("eval_batch_size", "per_device_eval_batch_size", 8),
        EVAL_STRATEGY,
    ),
    output_key="output_dir",
    resume_key="resume_from_checkpoint",
    required={
        "model_name_or_path": "add model_name_or_path: a local model directory (the child runs offline)",
        "use_peft": "add use_peft: true: the supervisor supervises LoRA / QLoRA fine-tunes",
    },
    # trl's script parses its YAML without failing on unknown keys, so these older configs' names
    # are dropped in silence (trl 0.20 renamed max_seq_length; transformers 5 torch_dtype and
    # evaluation_strategy).
    renamed={"max_seq_length": "max_length", "torch_dtype": "dtype", "evaluation_strategy": "eval_strategy"},
    reads_quoted_numbers=True,
    contradictions=(
        auto_batch("auto_find_batch_size", "per_device_train_batch_size", "gradient_accumulation_steps"),
        resume("resume_from_checkpoint"),
        no_saves("save_strategy"),
        Contradiction("use_peft", lambda v: v is not True, "not a LoRA fine-tune", "set use_peft: true"),
        *TRAINER_ARGUMENTS_CONTRADICTIONS,
        # Keys `trl sft` hands to `accelerate launch` (the config's keys no dataclass knows,
        # cli/commands/training.py); the supervisor starts the script as one process, so they
        # would be dropped in silence.
        Contradiction(
            "accelerate_config",
            present,
            "an argument of trl's `accelerate launch`: the supervisor starts one process without it",
            "delete accelerate_config (one process on the job's GPU; DeepSpeed, FSDP: not supervised yet)",
        ),
        Contradiction("num_processes", lambda v: v not in (None, 1), MULTI_GPU, "delete num_processes"),
        Contradiction("num_machines", lambda v: v not in (None, 1), MULTI_GPU, "delete num_machines"),
        *(
            Contradiction(key, is_true, MULTI_GPU, f"delete {key}")
            for key in ("multi_gpu", "use_deepspeed", "use_fsdp")
        ),
    ),
)

#: accelerate launch's arguments a trl config may carry (not fields of trl's dataclasses).
TRL_LAUNCH_KEYS = frozenset(
    {"accelerate_config", "num_processes", "num_machines", "multi_gpu", "use_deepspeed", "use_fsdp"}
)

#: The knob each rung changes (policies/rungs.py); None: a rung no foreign tool can take.
RUNG_KNOBS: Mapping[str, str | None] = {r.name: r.knob if r.tool_can_take else None for r in RUNGS}


def _gradient_checkpointing(value: Any) -> Any:
    # axolotl's "offload" / "offload_disk" are checkpointing with the saved activations elsewhere: on.
    return value in ("offload", "offload_disk") or value


def _4bit(value: Any) -> Any:
    # None: no quantization_bit, LLaMA-Factory loads unquantized (False, a bool like every knob);
    # another type is passed on for the type check to name.
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value == 4
    return value


def _lora_only(key: str, allowed: tuple[str, ...]) -> Contradiction:
    return Contradiction(
        key,
        lambda v: v not in allowed,
        "not a LoRA fine-tune: the supervisor supervises LoRA / QLoRA",
        f"set {key}: {allowed[0]}",
    )


AXOLOTL = Table(
    TrainerKind.AXOLOTL,
    rows=(
        Row("model", "base_model", None),
        Row("micro_batch_size", "micro_batch_size", 1),
        Row("grad_accum", "gradient_accumulation_steps", 1),
        Row("gradient_checkpointing", "gradient_checkpointing", False, read=_gradient_checkpointing),
        Row("optimizer", "optimizer", "adamw_torch_fused"),
        Row("max_seq_len", "sequence_len", 512),
        Row("lora_r", "lora_r", None),
        Row("lora_alpha", "lora_alpha", None),
        Row("load_in_4bit", "load_in_4bit", False, read_only=True),
        # axolotl's qlora loader: nf4 with double quantization unless bnb_config_kwargs says otherwise.
        Row("quant_type", "bnb_config_kwargs.bnb_4bit_quant_type", "nf4"),
        Row("double_quant", "bnb_config_kwargs.bnb_4bit_use_double_quant", True),
        # None: axolotl uses micro_batch_size (utils/config normalize_config).
        Row("eval_batch_size", "eval_batch_size", lambda config: config.get("micro_batch_size") or 1),
        # axolotl evaluates on a split of the training data (val_set_size, default 0: none) or on
        # test_datasets; read only: the ladder's eval rungs change the eval batch, not whether.
        Row(
            "eval_enabled",
            "val_set_size",
            lambda config: 1.0 if config.get("test_datasets") else 0.0,
            read=lambda v: v > 0 if isinstance(v, (int, float)) and not isinstance(v, bool) else v,
            read_only=True,
        ),
    ),
    output_key="output_dir",
    resume_key="resume_from_checkpoint",
    required={
        "base_model": "add base_model: a local model directory (the child runs offline)",
        "adapter": "add adapter: qlora (or lora): the supervisor supervises LoRA / QLoRA fine-tunes",
        "lora_r": "add lora_r (axolotl has no default rank)",
        "lora_alpha": "add lora_alpha (axolotl has no default)",
    },
    contradictions=(
        auto_batch("auto_find_batch_size", "micro_batch_size", "gradient_accumulation_steps"),
        resume("resume_from_checkpoint"),
        Contradiction(
            "auto_resume_from_checkpoints",
            is_true,
            "axolotl would pick its own checkpoint in output_dir, not the one the supervisor checked",
            "delete auto_resume_from_checkpoints: the supervisor resumes from its newest complete checkpoint",
        ),
        no_saves("save_strategy"),
        _lora_only("adapter", ("qlora", "lora")),
        # axolotl 0.19's schema defaults gradient_accumulation_steps to 1 before its CLI would derive
        # it from batch_size, so batch_size alone trains at accumulation 1 (older versions derived
        # batch_size // micro_batch_size): one meaning only, the accumulation written out.
        Contradiction(
            "batch_size",
            present,
            "which accumulation it means depends on the axolotl version (0.19 trains at "
            "gradient_accumulation_steps 1 and counts steps by batch_size; older ones derived it)",
            "delete batch_size and write gradient_accumulation_steps: batch_size / micro_batch_size",
        ),
        # axolotl's own schema refuses it at load (its LoraConfig validator); here it is named at
        # validate, before a card is taken.
        Contradiction(
            "adapter",
            lambda v: v == "qlora",
            'qlora without load_in_4bit: true: axolotl stops at load ("Require cfg.load_in_4bit to be '
            'True for qlora")',
            "set load_in_4bit: true (or adapter: lora for a LoRA on unquantized weights)",
            given=lambda config: config.get("load_in_4bit") is not True and not config.get("merge_lora"),
        ),
        *TRAINER_ARGUMENTS_CONTRADICTIONS,
        Contradiction("fsdp_config", present, MULTI_GPU, "delete fsdp_config"),
    ),
    targets_key="lora_target_modules",
    data_key="datasets",
    epochs_key="num_epochs",
    epochs_default=1.0,
    reads_quoted_numbers=True,
)

LLAMAFACTORY = Table(
    TrainerKind.LLAMAFACTORY,
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
        EVAL_STRATEGY,
    ),
    output_key="output_dir",
    resume_key="resume_from_checkpoint",
    required={
        "model_name_or_path": "add model_name_or_path: a local model directory (the child runs offline)",
        "do_train": "add do_train: true",
    },
    contradictions=(
        auto_batch("auto_find_batch_size", "per_device_train_batch_size", "gradient_accumulation_steps"),
        resume("resume_from_checkpoint"),
        no_saves("save_strategy"),
        _lora_only("finetuning_type", ("lora",)),
        *TRAINER_ARGUMENTS_CONTRADICTIONS,
    ),
    targets_key="lora_target",
    data_key="dataset",
)

#: HfArgumentParser's ``string_to_bool``: the words a bool flag takes (flags.parse leaves yes/no
#: as words, since a string field such as --save_strategy no must stay "no").
_ARGPARSE_BOOLS = {"yes": True, "y": True, "t": True, "no": False, "n": False, "f": False}


def _argparse_bool(value: Any) -> Any:
    """A bool flag's word or 0/1 as HfArgumentParser reads it; anything else for the type check."""
    if isinstance(value, str) and value.lower() in _ARGPARSE_BOOLS:
        return _ARGPARSE_BOOLS[value.lower()]
    if isinstance(value, int) and not isinstance(value, bool) and value in (0, 1):
        return bool(value)
    return value


#: An HfArgumentParser script: transformers' TrainingArguments flags, whose names every such
#: script shares. The model, sequence length, LoRA and 4-bit flags are the script's own: their
#: rows apply only where the user's command has the flag (``present_only``), so no flag the
#: script does not define is ever added (HfArgumentParser refuses unknown flags).
HF_SCRIPT = Table(
    TrainerKind.HF_SCRIPT,
    rows=(
        Row("model", "model_name_or_path", None),
        Row("micro_batch_size", "per_device_train_batch_size", 8),
        Row("grad_accum", "gradient_accumulation_steps", 1),
        Row(
            "gradient_checkpointing",
            "gradient_checkpointing",
            False,
            read=_argparse_bool,
            preferred=ACTIVATION_CHECKPOINTING,
        ),
        Row("optimizer", "optim", "adamw_torch_fused"),
        Row("eval_batch_size", "per_device_eval_batch_size", 8),
        EVAL_STRATEGY,
        Row("max_seq_len", "max_seq_length", 512, present_only=True),
        Row("lora_r", "lora_r", 8, present_only=True),
        Row("lora_alpha", "lora_alpha", 16, present_only=True),
        Row("load_in_4bit", "load_in_4bit", False, read=_argparse_bool, present_only=True),
    ),
    output_key="output_dir",
    resume_key="resume_from_checkpoint",
    required={"output_dir": "add --output_dir (TrainingArguments requires it; the supervisor replaces it)"},
    contradictions=(
        auto_batch("auto_find_batch_size", "--per_device_train_batch_size", "--gradient_accumulation_steps"),
        resume("resume_from_checkpoint"),
        no_saves("save_strategy"),
        *(unquoted_no(key) for key in STRATEGY_KEYS),
        Contradiction("deepspeed", present, MULTI_GPU, "delete --deepspeed"),
        Contradiction("fsdp", present, MULTI_GPU, "delete --fsdp"),
    ),
    data_key="dataset_name",
)

TABLES: Mapping[TrainerKind, Table] = {
    TrainerKind.TRL_SFT: TRL_SFT,
    TrainerKind.AXOLOTL: AXOLOTL,
    TrainerKind.LLAMAFACTORY: LLAMAFACTORY,
    TrainerKind.HF_SCRIPT: HF_SCRIPT,
}


def rungs_for(table: Table, config: Mapping[str, Any] | None = None) -> frozenset[str]:
    """The rungs whose knob this tool's config can express."""
    knobs = {row.knob for row in table.rows if writable(row, config)} | {"expandable_segments"}
    return frozenset(name for name, knob in RUNG_KNOBS.items() if knob in knobs)
