"""No dead ends after a rung: a new non-OOM failure right after a rung changed the config is the rung's.

A child that fails with an error (``other``, a config error, a bitsandbytes setup error) it did
not have before a rung changed its config, and trained no step with the new config, has that
failure charged to the rung: the change is deterministic, so retrying it unchanged repeats the
failure (issue 19: ``cpu_offload`` -> ``Tensor.item() cannot be called on meta tensors``, retried
three times). The rung is reverted (the next attempt starts from the config before it), it is
unusable for the rest of the run, and the ladder moves on from the failure that called for it.

When the change was a combination (the search's ``gradient_checkpointing+halve_micro_batch``),
every rung in it is charged: which one broke the child cannot be told apart, and the ladder has
others to try. The charges are derived from the history alone (each failed attempt and the one
before it), so a supervisor that restarts reads the same unusable rungs from the journal.
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
    """Every rung charged with a failure anywhere in ``history``, and every rung whose knob an
    attempt changed but its trainer did not take: unusable for the rest of the run."""
    charged = (charge_at(history, i) for i in range(len(history)))
    untaken = {knob for past in history for knob in past.unapplied}
    return frozenset(name for c in charged if c is not None for name in c.rungs) | frozenset(
        rung.name for rung in RUNGS if rung.knob in untaken
    )
