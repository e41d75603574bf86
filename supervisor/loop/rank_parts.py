"""The emergency checkpoint of a torchrun attempt, sealed from its ranks' parts when they agree.

Each rank that could writes its part of step N after the failure (``contract.checkpoints``); the
supervisor, once the attempt has ended, seals ``checkpoint-N`` from rank 0's part and every rank's
RNG state when every rank's part names the same step, and otherwise trusts none of them.
"""

from __future__ import annotations

import dataclasses
import shutil
from collections.abc import Sequence
from pathlib import Path

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.trainer_child.contract.checkpoints import (
    CHECKPOINT_PREFIX,
    RNG_FILE,
    agreed_parts,
    is_complete,
    part_step,
    publish,
)
from qlora_supervise.trainer_child.contract.disk_space import is_disk_full
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import Knobs


def seal_rank_parts(
    checkpoints_dir: Path, reports: Sequence[ErrorReport], knobs: Knobs, log: FilteringBoundLogger
) -> tuple[ErrorReport, ...]:
    """The ranks' reports, each naming the sealed checkpoint as its emergency checkpoint, or none
    when the parts do not agree (every rank's, of one step) or there are none."""
    parts = {r.rank: Path(r.emergency_checkpoint) for r in reports if r.emergency_checkpoint}
    if not parts:
        return tuple(reports)
    step = agreed_parts(list(parts.values()), knobs.world_size)
    sealed = None
    try:
        sealed = _seal(checkpoints_dir, parts, step, knobs) if step is not None and 0 in parts else None
    except OSError as exc:  # a part gone or unreadable: untrusted, like a missing one
        if is_disk_full(exc):
            raise  # the arbiter waits for room and reclaims the attempt
    if sealed is None:
        log.warning(
            Event.RANK_PARTS_UNTRUSTED,
            parts={str(rank): part_step(part) for rank, part in sorted(parts.items())},
            world_size=knobs.world_size,
            why="an emergency checkpoint needs every rank's part of the same step: the last regular "
            "checkpoint serves",
        )
    else:
        log.info(Event.RANK_PARTS_SEALED, step=step, path=str(sealed), ranks=sorted(parts))
    for parent in {part.parent for part in parts.values()}:  # sealed, or untrusted: never read again
        shutil.rmtree(parent, ignore_errors=True)
    found = str(sealed) if sealed is not None else None
    step_of = step if sealed is not None else None
    return tuple(dataclasses.replace(r, emergency_checkpoint=found, emergency_step=step_of) for r in reports)


def _seal(checkpoints_dir: Path, parts: dict[int, Path], step: int, knobs: Knobs) -> Path:
    final = checkpoints_dir / f"{CHECKPOINT_PREFIX}{step}"
    if is_complete(final):
        return final
    main = parts[0]
    for rank, part in parts.items():
        if rank != 0:
            name = RNG_FILE.format(rank=rank)
            shutil.copy2(part / name, main / name)
    return publish(main, final, step=step, knobs=knobs, emergency=True)
