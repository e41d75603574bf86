"""A tool is one :class:`Tool` record: its kind, package, argv, knob table, spellings and model facts.
Everything a tool does differently is a field here, so adding a tool is one module under
:mod:`.tools` and its line in :data:`.tools.TOOLS`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.jobfile.problems import Problem
from qlora_supervise.supervisor.trainers.mapping import lookup
from qlora_supervise.supervisor.trainers.tables import Table

Config = Mapping[str, Any]
#: A tool's attention value -> the memory model's reading (flash kernels keep no score tensor).
_ATTENTION = {"eager": "eager", "sdpa": "sdpa"}


def attn_implementation(config: Config) -> str | None:
    """transformers' ``attn_implementation`` as the memory model reads it (None: the default)."""
    value = lookup(config, "attn_implementation")
    if not isinstance(value, str):
        return None
    return _ATTENTION.get(value, "sdpa" if value.startswith("flash") else None)


def load_in_8bit(config: Config) -> str | None:
    """The key that loads the base model in 8-bit (None: it does not)."""
    return "load_in_8bit: true" if lookup(config, "load_in_8bit") is True else None


@dataclass(frozen=True)
class Tool:
    """One tool the supervisor can run in place of our child."""

    table: Table  # knob -> the tool's key; its kind is trainer.kind in the job file
    package: str | None = None  # what its interpreter must import (None: the script's own)
    # ``python *entry <config>``; (): a script that is its own argv (hf-script: its flags changed).
    entry: tuple[str, ...] = ()
    # ``script``: its argv runs unchanged; the shim changes the knobs where the script builds them.
    settings_in_code: bool = False
    # Rungs it takes through its shim rather than its config (script: bf16_head, smaller_model).
    shim_rungs: frozenset[str] = frozenset()
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
    # trl leaves what is not 4-bit in the dtype its script loads (no k-bit prepare): this key.
    head_dtype_key: str | None = None
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

    @property
    def config_name(self) -> str:
        """The attempt's file: the tool's config, or the script's argv (``command.json``)."""
        return f"{self.kind}.yaml" if self.entry else "command.json"
