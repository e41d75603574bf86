"""The knob each rung changes, and the rungs a tool's table can take.

Each tool's table (``tools/``) has one row per knob the ladder may change: the tool's key, its
default (``tests/test_trainer_tables.py`` checks them against the tool's own), how a value reads
and writes. A knob without a row cannot be changed for that tool, so the rungs that change it are
left out of its ladders.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qlora_supervise.policies.rungs import RUNGS
from qlora_supervise.supervisor.trainers.table_rows import Contradiction, Row, Table, writable

__all__ = ["RUNG_KNOBS", "Contradiction", "Row", "Table", "rungs_for", "writable"]

#: The knob each rung changes (policies/rungs.py); None: a rung no foreign tool can take.
RUNG_KNOBS: Mapping[str, str | None] = {r.name: r.knob if r.tool_can_take else None for r in RUNGS}


def rungs_for(table: Table, config: Mapping[str, Any] | None = None) -> frozenset[str]:
    """The rungs whose knob this tool's config can express."""
    knobs = {row.knob for row in table.rows if writable(row, config)} | {"expandable_segments"}
    return frozenset(name for name, knob in RUNG_KNOBS.items() if knob in knobs)
