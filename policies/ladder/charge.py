"""No dead ends after a rung: a new non-OOM failure right after a rung changed the config is the rung's.

A failure (``other``, a config error, a bitsandbytes setup error) the run did not have before a
rung changed its config, with no step trained, is charged to the rung: the change is
deterministic, so a retry repeats it (issue 19: ``cpu_offload`` -> meta tensors, three times).
The rung is reverted, unusable for the rest of the run, and the ladder moves on from the failure
that called for it. Every rung of a combination is charged (which one broke it cannot be told).
Charges derive from the history alone, so a restarted supervisor reads the same from the journal.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from qlora_supervise.policies.rungs import RUNGS
from qlora_supervise.policies.search.candidates import rungs_between
from qlora_supervise.policies.verdicts import PastAttempt
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage

#: Failures a config change can cause deterministically and a retry cannot fix.
CHARGEABLE = frozenset({FailureKind.OTHER, FailureKind.CONFIG_ERROR, FailureKind.BNB_CUDA_SETUP})
#: Where an OOM kind happened, for a past attempt journalled without its stage.
_STAGE_OF_KIND: Mapping[FailureKind, Stage] = {
    FailureKind.OOM_LOAD: Stage.LOAD,
    FailureKind.OOM_FORWARD: Stage.FORWARD,
    FailureKind.OOM_BACKWARD: Stage.BACKWARD,
    FailureKind.OOM_OPTIMIZER: Stage.OPTIMIZER,
    FailureKind.OOM_EVAL: Stage.EVAL,
    FailureKind.OOM_MERGE: Stage.MERGE,
}


@dataclass(frozen=True)
class Charge:
    """Rungs charged with the newest failure, and the attempt before them (its failure to climb from)."""

    rungs: tuple[str, ...]
    kind: FailureKind  # the failure charged
    before: PastAttempt  # the attempt whose failure the rungs answered


@dataclass(frozen=True)
class PastFailure:
    """An earlier attempt's failure, as the ladder needs it (kind and stage)."""

    kind: FailureKind
    stage: Stage
    numbers: Mapping[str, Any] = field(default_factory=dict)
    fatal_xid: int | None = None

    @classmethod
    def of(cls, past: PastAttempt) -> PastFailure:
        assert past.kind is not None  # a Charge's ``before`` failed
        return cls(past.kind, past.stage or _STAGE_OF_KIND.get(past.kind, Stage.FORWARD))


def charge_at(history: Sequence[PastAttempt], index: int) -> Charge | None:
    """The charge of attempt ``history[index]``'s failure, or None when it is not a rung's."""
    failed = history[index]
    if index == 0 or failed.kind not in CHARGEABLE or failed.steps_progressed > 0:
        return None
    before = history[index - 1]
    if before.kind is None or not before.kind.is_oom or before.knobs == failed.knobs:
        return None  # no rung changed the config for a memory failure just before
    if any(past.kind is failed.kind for past in history[:index] if past.knobs != failed.knobs):
        return None  # the run had this failure before the change: it is not the rung's
    rungs = rungs_between(before.knobs, failed.knobs)
    return Charge(rungs, failed.kind, before) if rungs else None


def latest_charge(history: Sequence[PastAttempt]) -> Charge | None:
    """The charge of the newest attempt's failure (history's last entry)."""
    return charge_at(history, len(history) - 1) if history else None


def unusable_rungs(history: Sequence[PastAttempt]) -> frozenset[str]:
    """The rungs unusable for the rest of the run: charged with a failure in ``history``, or whose
    knob an attempt changed but its trainer did not take."""
    charged = (charge_at(history, i) for i in range(len(history)))
    untaken = {knob for past in history for knob in past.unapplied}
    return frozenset(name for c in charged if c is not None for name in c.rungs) | frozenset(
        rung.name for rung in RUNGS if rung.knob in untaken
    )
