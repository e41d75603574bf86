"""A host OOM kill after progress: retried unchanged, and a ladder that cuts quality last.

On a shared host the kernel's OOM killer often picks the trainer for a neighbour's spike: the
biggest process loses, whatever caused the pressure. A kill that came after the attempt trained
steps says the config *did* fit for a while, so it is retried with the same knobs (issue 21
item 4). Kills are "in a row" only when the retry got no further: a second kill with the same
knobs at a step no later than the first one's is the config's own peak (the same batch, the same
step, every time) and walks the ladder; a kill after the retry trained past the first kill is a
new first kill, retried unchanged again (issue 29 item 7: two kills with 5 good steps between
them halved the LoRA rank). A kill before any step walks the ladder at once. This also holds at
the ladder's bottom: the run does not give up at the first kill after progress. Under activation
offload the child's own host use is the likely cause, so no plain retry: offload is charged at
once (:mod:`..choice`).

When the ladder walks for a host OOM, the stage the heartbeats last showed is only where the
process was when the kernel chose it, not what grew. So the throughput rungs come first (the
stage's own, then checkpointing and a smaller micro-batch, which never add host memory; never
offload or the paged optimizer, which move memory to the host, and :mod:`.climb` refuses any rung
the host model says needs more host RAM than the killed config), the
quality rungs last, and the LoRA rank is halved only when the evidence says the adapter is what
grew: a kill in the optimizer stage before the attempt finished its first step, where the
adapter's optimizer state is first allocated. After a step that state was already held.
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
    """Restart unchanged when ``failure`` is a host OOM kill after progress that is not in a row.

    ``failed``: the failed attempts, the one that just failed last. None: the ladder decides.
    """
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
    """The rungs for a host OOM at ``stage``: throughput first, quality last, the rank only when
    ``adapter_grew`` (module docstring), none that moves memory to the host (offload, the paged
    optimizer); a job's own ``host_oom`` ladder is taken as written."""
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
