"""A tool is one :class:`Tool` record: its kind, package, argv, knob table, spellings and model facts.

Each tool's module under :mod:`.tools` exports one; :data:`.tools.TOOLS` registers them, and the
job file's ``trainer.kind`` is one of its keys (or ``own``). Everything a tool does differently
is a field here, so adding a tool is one module and its registry line.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.jobfile.problems import Problem
from qlora_supervise.supervisor.trainers.mapping import lookup
from qlora_supervise.supervisor.trainers.table_rows import Table

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


def _nothing(config: Config, saved_4bit: bool) -> str | None:
    return None


def _no_data_problems(config: Config, where: str, workdir: Path) -> list[Problem]:
    return []


def _no_command_problems(command: tuple[str, ...], workdir: Path) -> list[Problem]:
    return []


@dataclass(frozen=True)
class Tool:
    """One tool the supervisor can run in place of our child."""

    kind: str  # trainer.kind in the job file
    table: Table  # knob -> the tool's key
    package: str | None  # what its interpreter must import (None: the script's own)
    # How the tool starts on an attempt's config: ``python *entry <config>``; () for a script that
    # is its own argv (hf-script: the job's trainer.command, its flags changed).
    entry: tuple[str, ...] = ()
    # The script's settings are in its code (``script``): its argv runs unchanged and the shim
    # changes the knobs where the script builds them (``script-knobs.json`` per attempt).
    settings_in_code: bool = False
    # Rungs of our child's that this tool takes all the same, through its shim rather than its
    # config (script: the bf16 head at prepare_model_for_kbit_training, the fallback model at
    # from_pretrained); the job may name fallbacks (trainer.fallbacks) only where smaller_model is one.
    shim_rungs: frozenset[str] = frozenset()
    # --- LoRA targets, as the tool hands them to peft (lora_targets.py) ---
    targets_regex: bool = True  # a string reaches peft as a regex of the full module name
    all_linear_words: tuple[str, ...] = ("all-linear",)  # the tool's own word for every Linear
    one_name_list_is_name: bool = False  # trl: [q_proj] reaches peft as "q_proj"
    peft_default_targets: bool = False  # nothing named: peft's default for the model type
    all_linear_key: str | None = None  # axolotl's lora_target_linear: true
    # --- what its config says of the model's memory (model_facts.py) ---
    attention: Callable[[Config], str | None] = attn_implementation
    eight_bit: Callable[[Config], str | None] = load_in_8bit
    # The tool's own reason the memory model cannot count a config (saved_4bit: the model
    # directory holds bitsandbytes 4-bit weights, loaded so whatever the keys say).
    unmodelled: Callable[[Config, bool], str | None] = _nothing
    # trl leaves what is not 4-bit in the dtype its script loads (no k-bit prepare): this key.
    head_dtype_key: str | None = None
    unquantized: str = (
        "the tool loads the base model unquantized, in its own dtype (a LoRA, not QLoRA); the memory "
        "model counts 4-bit weights"
    )
    # --- checks at validate ---
    data_problems: Callable[[Config, str, Path], list[Problem]] = _no_data_problems
    command_problems: Callable[[tuple[str, ...], Path], list[Problem]] = _no_command_problems

    @property
    def config_name(self) -> str:
        """The attempt's file: the tool's config, or the script's argv (``command.json``)."""
        return f"{self.kind}.yaml" if self.entry else "command.json"
