"""A tool is one :class:`Tool` record: everything it does differently is a field, so adding a tool is
one module under :mod:`.tools` and its line in :data:`.tools.TOOLS`. Its :class:`Table` has one row per
knob the ladder may change (the tool's key, default, how a value reads and writes) and the keys that
contradict the ladder; a knob without a row cannot be changed: its rungs leave its ladders."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qlora_supervise.policies.rungs import RUNGS
from qlora_supervise.supervisor.jobfile.problems import Problem
from qlora_supervise.trainer_child.contract.script_knobs import EVAL_SCHEDULERS

Config = Mapping[str, Any]
#: The knob each rung changes (policies/rungs.py); None: a rung no foreign tool can take.
RUNG_KNOBS: Mapping[str, str | None] = {r.name: r.knob if r.tool_can_take else None for r in RUNGS}
MULTI_GPU = "DeepSpeed and FSDP are not supervised yet (one process; the ladder's knobs are per process)"
#: A tool's attention value -> the memory model's reading (flash kernels keep no score tensor).
_ATTENTION = {"eager": "eager", "sdpa": "sdpa"}


@dataclass(frozen=True)
class Row:
    """Knob ``knob`` is the tool's ``key``; ``default`` where the config has none (callable: of config)."""

    knob: str
    key: str
    default: Any
    read: Callable[[Any], Any] = lambda value: value  # tool's value -> knob value
    write: Callable[[Any], Any] = lambda value: value  # knob value -> tool's value
    read_only: bool = False  # never written: changing it alone would not do what the rung means here
    present_only: bool = False  # the script's own key, not the tool's: read and written only where set
    preferred: tuple[str, ...] = ()  # newer names the tool reads first where set (activation_checkpointing)
    # Keys the tool refuses left on beside this knob written off: where the config has them, off too.
    off_with: tuple[str, ...] = ()
    # Where the rest of the config needs the knob as it is: never written, so its rungs leave the ladder.
    held: Callable[[Config], bool] = lambda config: False

    def key_in(self, config: Config) -> str:
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
    given: Callable[[Config], bool] = lambda config: True  # only where the rest of the config agrees


@dataclass(frozen=True)
class Table:
    kind: str
    rows: tuple[Row, ...]
    output_key: str = "output_dir"  # where the tool writes its own outputs: the run's trainer-output/
    resume_key: str = "resume_from_checkpoint"
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
    renamed: Mapping[str, str] = field(default_factory=dict)  # old -> new names its parser drops silently
    reads_quoted_numbers: bool = False  # "4" is 4 to the tool (trl's argparse, axolotl's pydantic)

    def row(self, knob: str) -> Row | None:
        return next((r for r in self.rows if r.knob == knob), None)


def restarts(micro_key: str, accum_key: str) -> tuple[Contradiction, ...]:
    """The TrainingArguments keys that would restart, resume or checkpoint in place of the supervisor."""
    why = (
        "contradicts the supervisor: on an OOM it lowers the batch size without raising accumulation "
        "(the effective batch changes) and retries from step 0 in the same process"
    )
    fix = (
        f"delete auto_find_batch_size (or set false): after an OOM the supervisor lowers {micro_key} "
        f"and raises {accum_key} to keep the effective batch, and resumes from the last checkpoint"
    )
    resumed = "set by the supervisor for each attempt (the newest complete checkpoint it checked)"
    resume_fix = (
        "delete resume_from_checkpoint: a run is resumed by running the same qlora-supervise command again"
    )
    return (
        Contradiction("auto_find_batch_size", bool, why, fix),
        Contradiction("resume_from_checkpoint", lambda v: v not in (None, False, ""), resumed, resume_fix),
        Contradiction(
            "save_strategy",
            lambda v: v == "no",
            "no checkpoints: every restart would begin at step 0",
            'set save_strategy: "steps" (with save_steps), or delete it',
        ),
    )


def lora_only(key: str, allowed: tuple[str, ...]) -> Contradiction:
    why = "not a LoRA fine-tune: the supervisor supervises LoRA / QLoRA"
    return Contradiction(key, lambda v: v not in allowed, why, f"set {key}: {allowed[0]}")


def is_true(value: Any) -> bool:
    return value is True


def present(value: Any) -> bool:
    return value not in (None, False, "", [], {})


def unquoted_no(key: str) -> Contradiction:
    """``key: no`` written unquoted: YAML hands the tool false, which no strategy field takes."""
    why = (
        "a bool, not a strategy: YAML reads an unquoted no (or off, false) as false, and the tool "
        'stops at load on it ("False is not a valid ...")'
    )
    fix = f'write {key}: "no" (quoted), or "steps" / "epoch"'
    return Contradiction(key, lambda v: isinstance(v, bool), why, fix)


#: TrainingArguments' strategy keys (axolotl's too): strings that YAML turns into bools unquoted.
STRATEGY_KEYS = ("eval_strategy", "save_strategy")
#: TrainingArguments' keys (axolotl spells them the same) that fight the supervisor in any config.
TRAINER_ARGUMENTS_CONTRADICTIONS = (
    *(unquoted_no(key) for key in STRATEGY_KEYS),
    Contradiction(
        "save_only_model",
        is_true,
        "checkpoints without optimizer state: every resume would start the optimizer afresh",
        "delete save_only_model (or set false)",
    ),
    *(Contradiction(key, present, MULTI_GPU, f"delete {key}") for key in ("deepspeed", "fsdp")),
)
#: transformers 5's name of checkpointing in TrainingArguments: read before gradient_checkpointing.
ACTIVATION_CHECKPOINTING = ("activation_checkpointing",)
#: TrainingArguments' eval switch, as a knob: any strategy but "no" is on. Its __post_init__ refuses
#: load_best_model_at_end without eval (the eval and save strategies must match), and a scheduler
#: that steps on the eval loss: eval stays on rather than the schedule changing.
EVAL_STRATEGY = Row(
    "eval_enabled",
    "eval_strategy",
    "no",
    read=lambda v: v != "no",
    write=lambda v: "steps" if v else "no",
    off_with=("load_best_model_at_end",),
    held=lambda config: config.get("lr_scheduler_type") in EVAL_SCHEDULERS,
)


def writable(row: Row, config: Config | None) -> bool:
    """Whether the ladder may write ``row`` in ``config`` (None: any config of the tool)."""
    if row.read_only or (config is not None and row.held(config)):
        return False
    return not row.present_only or (config is not None and row.key in config)


def settable(table: Table, config: Config | None) -> set[str]:
    """The knobs the ladder may set in ``config``, and expandable_segments (any torch process takes it)."""
    return {row.knob for row in table.rows if writable(row, config)} | {"expandable_segments"}


def rungs_for(table: Table, config: Config | None = None) -> frozenset[str]:
    """The rungs whose knob this tool's config can express."""
    return frozenset(name for name, knob in RUNG_KNOBS.items() if knob in settable(table, config))


def attn_implementation(config: Config) -> str | None:
    """transformers' ``attn_implementation`` as the memory model reads it (None: the default)."""
    value = config.get("attn_implementation")
    if not isinstance(value, str):
        return None
    return _ATTENTION.get(value, "sdpa" if value.startswith("flash") else None)


def load_in_8bit(config: Config) -> str | None:
    """The key that loads the base model in 8-bit (None: it does not)."""
    return "load_in_8bit: true" if config.get("load_in_8bit") is True else None


@dataclass(frozen=True)
class Tool:
    """One tool the supervisor can run in place of our child."""

    table: Table  # knob -> the tool's key; its kind is trainer.kind in the job file
    package: str | None = None  # what its interpreter must import (None: the script's own)
    entry: tuple[str, ...] = ()  # ``python *entry <config>``; (): a script, its own argv (flags changed)
    settings_in_code: bool = False  # script: runs as written; the shim changes knobs where it builds them
    shim_rungs: frozenset[str] = frozenset()  # rungs its shim takes (script: bf16_head, smaller_model)
    # --- LoRA targets, as the tool hands them to peft (model_facts.py) ---
    targets_regex: bool = True  # a string reaches peft as a regex of the full module name
    all_linear_words: tuple[str, ...] = ("all-linear",)  # the tool's own word for every Linear
    one_name_list_is_name: bool = False  # trl: [q_proj] reaches peft as "q_proj"
    peft_default_targets: bool = False  # nothing named: peft's default for the model type
    all_linear_key: str | None = None  # axolotl's lora_target_linear: true
    # --- what its config says of the model's memory (model_facts.py) ---
    attention: Callable[[Config], str | None] = attn_implementation
    eight_bit: Callable[[Config], str | None] = load_in_8bit
    # The tool's own reason the memory model cannot count a config (bool: saved in bnb 4-bit).
    unmodelled: Callable[[Config, bool], str | None] = lambda config, saved_4bit: None
    head_dtype_key: str | None = None  # trl: the load dtype's key, kept for what is not 4-bit (no k-bit prep)
    unquantized: str = (
        "the tool loads the base model unquantized, in its own dtype (a LoRA, not QLoRA); the memory "
        "model counts 4-bit weights"
    )
    # --- checks at validate ---
    data_problems: Callable[[Config, str, Path], list[Problem]] = lambda config, where, workdir: []
    command_problems: Callable[[tuple[str, ...], Path], list[Problem]] = lambda command, workdir: []

    @property
    def kind(self) -> str:
        return self.table.kind
