"""The ladders of a foreign trainer: the built-in ones (or the job's overrides) without the rungs
its config cannot express, and the pre-flight's choice kept only when it uses none of those.

A rung the tool cannot take is left out rather than tried: its knob would change in our
journal while the tool trained on as before, and the same failure would come back.
"""

from __future__ import annotations

from collections.abc import Mapping

from qlora_supervise.policies.candidates import rungs_between
from qlora_supervise.policies.ladders import DEFAULT_LADDERS
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.record.records import PlanNote
from qlora_supervise.supervisor.trainers.foreign import ForeignTrainer
from qlora_supervise.supervisor.trainers.tables import rungs_for
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.spec import Knobs


def foreign_overrides(
    trainer: ForeignTrainer, overrides: Mapping[FailureKind, tuple[str, ...]]
) -> dict[FailureKind, tuple[str, ...]]:
    """Every stage ladder (the job's override, else the default) with only the tool's rungs; the
    stage-dependent kinds (fragmentation, host OOM) then climb these through the stage."""
    allowed = rungs_for(trainer.table, trainer.config)
    kinds = {**DEFAULT_LADDERS, **overrides}
    return {kind: tuple(name for name in ladder if name in allowed) for kind, ladder in kinds.items()}


def foreign_first_plan(trainer: ForeignTrainer, job: Knobs, plan: Plan) -> Plan:
    """``plan`` when its changes are all rungs the tool can take; else the job as written, saying why."""
    foreign = [
        name
        for name in rungs_between(job, plan.knobs)
        if name not in rungs_for(trainer.table, trainer.config)
    ]
    if not foreign:
        return plan
    why = (
        f"pre-flight chose {', '.join(foreign)}, which {trainer.kind.value} cannot be told: "
        "the job starts as written and the ladder (the tool's rungs only) guards it"
    )
    note = plan.note
    reasons = (*(note.why if note is not None else ()), why)
    budget = note.budget if note is not None else None
    return Plan(
        plan.phase, job, note=PlanNote(None, budget, reasons, as_written=True), nothing_fits=plan.nothing_fits
    )
