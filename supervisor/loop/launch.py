"""The child's command line: one process, or for ``Knobs.world_size`` N > 1 torchrun's ranks
(``python -m torch.distributed.run --standalone --nproc-per-node N ...``; never a launcher of our own).

``--max-restarts 0``: retrying is the supervisor's job, with a new config when the failure says so.
``--shutdown-timeout``: the supervisor's stop grace (torchrun's 30 s could cut a GPU checkpoint
short). The spec path stays on every rank's command line: reclaim finds orphans by it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from qlora_supervise.trainer_child.contract import entry
from qlora_supervise.trainer_child.contract.spec import AttemptSpec

TRAINER_MODULE = entry.ATTEMPT
MERGE_MODULE = entry.MERGE
#: torchrun's module, run with this interpreter so the ranks import the same packages as one child.
TORCHRUN_MODULE = "torch.distributed.run"


def command(spec_path: Path, phase: str, world_size: int = 1, shutdown_timeout_s: float = 180.0) -> list[str]:
    """The argv of one attempt; ``world_size`` > 1 starts that many ranks through torchrun."""
    if phase == "merge":
        return [sys.executable, "-m", MERGE_MODULE, "--spec", str(spec_path)]
    child = ["-m", TRAINER_MODULE, "--spec", str(spec_path)]
    if world_size <= 1:
        return [sys.executable, *child]
    grace = str(max(1, round(shutdown_timeout_s)))
    ranks = ["--standalone", "--nproc-per-node", str(world_size), "--max-restarts", "0"]
    return [sys.executable, "-m", TORCHRUN_MODULE, *ranks, "--shutdown-timeout", grace, *child]


def spec_command(spec_path: Path, phase: str) -> list[str]:
    """The argv for the spec at ``spec_path``; an unreadable spec starts one process, which reports it."""
    try:
        spec = AttemptSpec.from_json(spec_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError, KeyError):
        return command(spec_path, phase)
    if spec.command and phase != "merge":  # a foreign trainer (supervisor/trainers/): its own argv
        return list(spec.command)
    return command(spec_path, phase, spec.knobs.world_size, spec.stop_grace_s)
