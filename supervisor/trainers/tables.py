"""The knob -> key table of each tool, the keys that contradict the ladder, and the rungs each can take.

One row per knob the ladder may change: the tool's key (a dotted path for a nested one), the
tool's own default when the key is absent (``tests/test_trainer_tables.py`` checks them against
the tool's dataclasses or schema), and how a value reads and writes where the tool spells it
differently (LLaMA-Factory's ``quantization_bit: 4`` for 4-bit, its inverted
``disable_gradient_checkpointing``). A knob without a row cannot be changed for that tool, so the
rungs that change it are left out of its ladders (:data:`RUNGS`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any


class TrainerKind(str, enum.Enum):
    OWN = "own"
    TRL_SFT = "trl-sft"
    AXOLOTL = "axolotl"
    LLAMAFACTORY = "llamafactory"
    HF_SCRIPT = "hf-script"


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Row:
    """Knob ``knob`` is the tool's ``key``; ``default`` applies where the config leaves it out
    (a callable: computed from the rest of the config)."""

    knob: str
    key: str
    default: Any
    read: Callable[[Any], Any] = _same  # tool's value -> knob value
    write: Callable[[Any], Any] = _same  # knob value -> tool's value
    # Read for the knobs (the memory model, the journal) but never written: changing it alone
    # would not do what the rung means in this tool (axolotl's 4-bit needs ``adapter: qlora`` too).
    read_only: bool = False
    # The key is the script's own, not the tool's: read and written only where the config has it.
    present_only: bool = False
    # Newer names of the key that the tool reads first where the config has them (transformers
    # 5's ``activation_checkpointing``, of which ``gradient_checkpointing`` is a deprecated alias).
    preferred: tuple[str, ...] = ()

    def key_in(self, config: Mapping[str, Any]) -> str:
        """The key the tool reads this knob from in ``config``: a preferred one set there (not null:
        TrainingArguments falls back to the alias when the new name is None), else ``key``."""
        return next((name for name in self.preferred if config.get(name) is not None), self.key)


@dataclass(frozen=True)
class Contradiction:
    """A key whose value fights the supervisor; ``bad`` says which values do."""

    key: str
    bad: Callable[[Any], bool]
    problem: str
    fix: str
    # Only where the rest of the config says so too (a value that is wrong beside another one).
    given: Callable[[Mapping[str, Any]], bool] = lambda config: True


@dataclass(frozen=True)
class Table:
    kind: TrainerKind
    rows: tuple[Row, ...]
    output_key: str  # where the tool writes its own outputs: the run's trainer-output/
    resume_key: str  # the tool's resume_from_checkpoint
    required: Mapping[str, str] = field(default_factory=dict)  # key -> fix, when absent
    contradictions: tuple[Contradiction, ...] = ()
    # Read for the supervisor's own bookkeeping (progress, the memory model), never written.
    max_steps_key: str = "max_steps"
    epochs_key: str = "num_train_epochs"
    epochs_default: float = 3.0  # TrainingArguments' own
    save_steps_key: str = "save_steps"
    save_steps_default: int = 500
    targets_key: str = "lora_target_modules"
    data_key: str = "dataset_name"
    # Old names the tool no longer reads (its parser drops them without a word): old -> new.
    renamed: Mapping[str, str] = field(default_factory=dict)

    def row(self, knob: str) -> Row | None:
        return next((r for r in self.rows if r.knob == knob), None)


_AUTO_BATCH = (
    "contradicts the supervisor: on an OOM it lowers the batch size without raising accumulation "
    "(the effective batch changes) and retries from step 0 in the same process"
)


def _auto_batch(key: str, micro_key: str, accum_key: str) -> Contradiction:
    return Contradiction(
        key,
        bool,
        _AUTO_BATCH,
        f"delete {key} (or set false): after an OOM the supervisor lowers {micro_key} and raises "
        f"{accum_key} to keep the effective batch, and resumes from the last checkpoint",
    )


def _resume(key: str) -> Contradiction:
    return Contradiction(
        key,
        lambda v: v not in (None, False, ""),
        "set by the supervisor for each attempt (the newest complete checkpoint it checked)",
        f"delete {key}: a run is resumed by running the same qlora-supervise command again",
    )


def _no_saves(key: str) -> Contradiction:
    return Contradiction(
        key,
        lambda v: v == "no",
        "no checkpoints: every restart would begin at step 0",
        f'set {key}: "steps" (with save_steps), or delete it',
    )


def _is_true(value: Any) -> bool:
    return value is True


def _present(value: Any) -> bool:
    return value not in (None, False, "", [], {})


_MULTI_GPU = "DeepSpeed and FSDP are not supervised yet (one process; the ladder's knobs are per process)"
#: Keys of transformers' TrainingArguments (axolotl spells them the same) that would fight the
#: supervisor, the same in every tool's config that has them.
_TRAINER_ARGUMENTS_CONTRADICTIONS = (
    Contradiction(
        "save_only_model",
        _is_true,
        "checkpoints without optimizer state: every resume would start the optimizer afresh",
        "delete save_only_model (or set false)",
    ),
    Contradiction("deepspeed", _present, _MULTI_GPU, "delete deepspeed"),
    Contradiction("fsdp", _present, _MULTI_GPU, "delete fsdp"),
)
#: transformers 5's name of checkpointing in TrainingArguments: read before gradient_checkpointing.
_ACTIVATION_CHECKPOINTING = ("activation_checkpointing",)
#: TrainingArguments' eval switch, as a knob: any strategy but "no" is on.
_EVAL_STRATEGY = Row(
    "eval_enabled",
    "eval_strategy",
    "no",
    read=lambda v: v != "no",
    write=lambda v: "steps" if v else "no",
)

TRL_SFT = Table(
    TrainerKind.TRL_SFT,
    rows=(
        Row("model", "model_name_or_path", None),
        Row("micro_batch_size", "per_device_train_batch_size", 8),
        Row("grad_accum", "gradient_accumulation_steps", 1),
        Row("gradient_checkpointing", "gradient_checkpointing", True, preferred=_ACTIVATION_CHECKPOINTING),
        Row("optimizer", "optim", "adamw_torch_fused"),
        Row("max_seq_len", "max_length", 1024),
        Row("lora_r", "lora_r", 16),
        Row("lora_alpha", "lora_alpha", 32),
        Row("load_in_4bit", "load_in_4bit", False),
        Row("quant_type", "bnb_4bit_quant_type", "nf4"),
        Row("double_quant", "use_bnb_nested_quant", False),
        Row("eval_batch_size", "per_device_eval_batch_size", 8),
        _EVAL_STRATEGY,
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
    contradictions=(
        _auto_batch("auto_find_batch_size", "per_device_train_batch_size", "gradient_accumulation_steps"),
        _resume("resume_from_checkpoint"),
        _no_saves("save_strategy"),
        Contradiction("use_peft", lambda v: v is not True, "not a LoRA fine-tune", "set use_peft: true"),
        *_TRAINER_ARGUMENTS_CONTRADICTIONS,
    ),
)

#: The knob each rung changes (policies/rungs.py); None: a rung no foreign tool can take (our
#: child's own features: the bf16 head, activation offload, the merge; a smaller model or one
#: rank fewer, whose checkpoints the tool could not resume). ``expandable_segments`` is the
#: allocator's environment variable, the same for any torch process.
RUNG_KNOBS: Mapping[str, str | None] = {
    "expandable_segments": "expandable_segments",
    "gradient_checkpointing": "gradient_checkpointing",
    "halve_micro_batch": "micro_batch_size",
    "shorten_seq_len": "max_seq_len",
    "paged_8bit_optimizer": "optimizer",
    "halve_lora_rank": "lora_r",
    "quantize_4bit": "load_in_4bit",
    "halve_eval_batch": "eval_batch_size",
    "disable_eval": "eval_enabled",
    "bf16_head": None,
    "activation_offload": None,
    "merge_on_cpu": None,
    "smaller_model": None,
    "drop_rank": None,
}


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
        _auto_batch("auto_find_batch_size", "micro_batch_size", "gradient_accumulation_steps"),
        _resume("resume_from_checkpoint"),
        Contradiction(
            "auto_resume_from_checkpoints",
            _is_true,
            "axolotl would pick its own checkpoint in output_dir, not the one the supervisor checked",
            "delete auto_resume_from_checkpoints: the supervisor resumes from its newest complete checkpoint",
        ),
        _no_saves("save_strategy"),
        _lora_only("adapter", ("qlora", "lora")),
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
        *_TRAINER_ARGUMENTS_CONTRADICTIONS,
        Contradiction("fsdp_config", _present, _MULTI_GPU, "delete fsdp_config"),
    ),
    targets_key="lora_target_modules",
    data_key="datasets",
    epochs_key="num_epochs",
    epochs_default=1.0,
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
        _EVAL_STRATEGY,
    ),
    output_key="output_dir",
    resume_key="resume_from_checkpoint",
    required={
        "model_name_or_path": "add model_name_or_path: a local model directory (the child runs offline)",
        "do_train": "add do_train: true",
    },
    contradictions=(
        _auto_batch("auto_find_batch_size", "per_device_train_batch_size", "gradient_accumulation_steps"),
        _resume("resume_from_checkpoint"),
        _no_saves("save_strategy"),
        _lora_only("finetuning_type", ("lora",)),
        *_TRAINER_ARGUMENTS_CONTRADICTIONS,
    ),
    targets_key="lora_target",
    data_key="dataset",
)

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
        Row("gradient_checkpointing", "gradient_checkpointing", False, preferred=_ACTIVATION_CHECKPOINTING),
        Row("optimizer", "optim", "adamw_torch_fused"),
        Row("eval_batch_size", "per_device_eval_batch_size", 8),
        _EVAL_STRATEGY,
        Row("max_seq_len", "max_seq_length", 512, present_only=True),
        Row("lora_r", "lora_r", 8, present_only=True),
        Row("lora_alpha", "lora_alpha", 16, present_only=True),
        Row("load_in_4bit", "load_in_4bit", False, present_only=True),
    ),
    output_key="output_dir",
    resume_key="resume_from_checkpoint",
    required={"output_dir": "add --output_dir (TrainingArguments requires it; the supervisor replaces it)"},
    contradictions=(
        _auto_batch("auto_find_batch_size", "--per_device_train_batch_size", "--gradient_accumulation_steps"),
        _resume("resume_from_checkpoint"),
        _no_saves("save_strategy"),
        Contradiction("deepspeed", _present, _MULTI_GPU, "delete --deepspeed"),
        Contradiction("fsdp", _present, _MULTI_GPU, "delete --fsdp"),
    ),
    data_key="dataset_name",
)

TABLES: Mapping[TrainerKind, Table] = {
    TrainerKind.TRL_SFT: TRL_SFT,
    TrainerKind.AXOLOTL: AXOLOTL,
    TrainerKind.LLAMAFACTORY: LLAMAFACTORY,
    TrainerKind.HF_SCRIPT: HF_SCRIPT,
}


def writable(row: Row, config: Mapping[str, Any] | None) -> bool:
    """Whether the ladder may write ``row`` in ``config`` (None: any config of the tool)."""
    if row.read_only:
        return False
    return not row.present_only or (config is not None and row.key in config)


def rungs_for(table: Table, config: Mapping[str, Any] | None = None) -> frozenset[str]:
    """The rungs whose knob this tool's config can express."""
    knobs = {row.knob for row in table.rows if writable(row, config)} | {"expandable_segments"}
    return frozenset(name for name, knob in RUNG_KNOBS.items() if knob in knobs)
