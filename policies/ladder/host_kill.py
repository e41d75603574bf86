"""A host OOM kill after progress: retried unchanged, and a ladder that cuts quality last.

On a shared host the OOM killer often picks the trainer for a neighbour's spike, so a kill after
the attempt trained steps is retried with the same knobs. Kills are "in a row" only when the retry
got no further (a second kill with the same knobs at a step no later than the first's is the
config's own peak, and walks the ladder); a kill before any step walks at once, as does one under
activation offload (offload is charged, :mod:`..choice`).

The stage of a host OOM is only where the process was when the kernel chose it, not what grew. So
its ladder takes throughput rungs first (checkpointing and a smaller micro-batch, never offload or
the paged optimizer, which move memory to the host), quality last, and the LoRA rank only when the
adapter is what grew: a kill in the optimizer stage before the first step, when its state is made.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from qlora_supervise.policies.ladder.ladders import ladder_for
from qlora_supervise.policies.rungs import RUNG_CLASSES, CostClass, Survives
from qlora_supervise.policies.verdicts import FailureLike, PastAttempt, Restart, Settings
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage
from qlora_supervise.trainer_child.contract.spec import Knobs

_STEP_STAGES = frozenset({Stage.FORWARD, Stage.BACKWARD, Stage.OPTIMIZER})
#: Throughput rungs that shrink a training step's memory without moving anything to the host.
_STEP_RUNGS = ("gradient_checkpointing", "halve_micro_batch")
_RANK = "halve_lora_rank"
#: Rungs that move memory from the card to the host: no way down after the host killed the child.
_HOST_RUNGS = frozenset({"activation_offload", "paged_8bit_optimizer"})


def retry_after_kill(failure: FailureLike, knobs: Knobs, failed: Sequence[PastAttempt]) -> Restart | None:
    """Restart unchanged when ``failure`` is a host OOM kill after progress that is not in a row;
    ``failed``: the failed attempts, this one last. None: the ladder decides."""
    if failure.kind is not FailureKind.HOST_OOM or not failed or failed[-1].steps_progressed <= 0:
        return None
    if knobs.activation_offload:  # the child itself held the host's RAM: offload is charged (choice.py)
        return None
    now = failed[-1]
    before = failed[-2] if len(failed) > 1 else None
    in_a_row = before is not None and before.kind is FailureKind.HOST_OOM and before.knobs == knobs
    if in_a_row and before is not None and now.reached <= before.reached:
        return None  # killed again no further than the last kill: the config's own peak
    why = (
        f"host OOM kill after {now.steps_progressed} step(s) of progress (at step {now.reached}): the "
        "config fitted until then and the kernel may have picked the trainer for another process's "
        "spike; retry unchanged before the ladder moves"
    )
    return Restart(knobs, "retry_unchanged", {}, why, Survives.ALL)


def host_ladder(stage: Stage, settings: Settings, adapter_grew: bool) -> tuple[str, ...]:
    """The rungs for a host OOM at ``stage`` (the module docstring); a job's own ``host_oom`` ladder
    is taken as written."""
    if FailureKind.HOST_OOM in settings.overrides:
        return settings.overrides[FailureKind.HOST_OOM]
    walked = ladder_for(FailureKind.HOST_OOM, stage, settings.overrides)
    names = tuple(n for n in walked if n not in _HOST_RUNGS)
    if stage in _STEP_STAGES:
        names = tuple(dict.fromkeys((*names, *_STEP_RUNGS)))
    quality = [n for n in names if RUNG_CLASSES.get(n) is CostClass.QUALITY and (n != _RANK or adapter_grew)]
    return (*(n for n in names if RUNG_CLASSES.get(n) is not CostClass.QUALITY), *quality)


def host_settings(failure: FailureLike, settings: Settings, failed: Sequence[PastAttempt]) -> Settings:
    """``settings`` with :func:`host_ladder` as the ``host_oom`` ladder for this failure."""
    if failure.kind is not FailureKind.HOST_OOM:
        return settings
    grew = failure.stage is Stage.OPTIMIZER and bool(failed) and failed[-1].steps_progressed <= 0
    ladder = host_ladder(failure.stage, settings, grew)
    return dataclasses.replace(settings, overrides={**settings.overrides, FailureKind.HOST_OOM: ladder})
