"""The knob each rung changes, and the rungs a tool's table can take.

Each tool's table (``tools/``) has one row per knob the ladder may change: the tool's key, its
default (``tests/test_trainer_tables.py`` checks them against the tool's own), how a value reads
and writes. A knob without a row cannot be changed for that tool, so the rungs that change it are
left out of its ladders.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qlora_supervise.supervisor.trainers.table_rows import Contradiction, Row, Table, writable

__all__ = ["RUNG_KNOBS", "Contradiction", "Row", "Table", "rungs_for", "writable"]

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
    # The resume stage's rungs: our child loads the optimizer state itself; a tool's resume is its own.
    "optimizer_state_on_host": None,
    "fresh_optimizer_state": None,
}


def rungs_for(table: Table, config: Mapping[str, Any] | None = None) -> frozenset[str]:
    """The rungs whose knob this tool's config can express."""
    knobs = {row.knob for row in table.rows if writable(row, config)} | {"expandable_segments"}
    return frozenset(name for name, knob in RUNG_KNOBS.items() if knob in knobs)
