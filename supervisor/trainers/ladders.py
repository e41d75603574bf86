"""The rungs a foreign trainer cannot take, and its ladders without them.

A rung the tool cannot take is left out rather than tried: its knob would change in our
journal while the tool trained on as before, and the same failure would come back. The
policy's settings carry the set (``Settings.cannot_take``), so the pre-flight (``run``'s first
plan and ``qlora-supervise plan``), the search after a failure and the ladder walk all leave
those rungs out.
"""

from __future__ import annotations

from collections.abc import Mapping

from qlora_supervise.policies.ladder.ladders import DEFAULT_LADDERS
from qlora_supervise.supervisor.trainers.foreign import ForeignTrainer
from qlora_supervise.supervisor.trainers.tables import RUNG_KNOBS, rungs_for
from qlora_supervise.trainer_child.contract.codes import FailureKind


def cannot_take(trainer: ForeignTrainer | None) -> frozenset[str]:
    """The rungs whose knob ``trainer``'s config cannot express (none for our own trainer)."""
    if trainer is None:
        return frozenset()
    return frozenset(RUNG_KNOBS) - rungs_for(trainer.table, trainer.config)


def foreign_overrides(
    trainer: ForeignTrainer, overrides: Mapping[FailureKind, tuple[str, ...]]
) -> dict[FailureKind, tuple[str, ...]]:
    """Every stage ladder (the job's override, else the default) with only the tool's rungs; the
    stage-dependent kinds (fragmentation, host OOM) then climb these through the stage."""
    allowed = rungs_for(trainer.table, trainer.config)
    kinds = {**DEFAULT_LADDERS, **overrides}
    return {kind: tuple(name for name in ladder if name in allowed) for kind, ladder in kinds.items()}
