"""The child's command line: one process, or torchrun's ranks (never a launcher of our own).

World size 1 (and every merge)::

    python -m qlora_supervise.trainer_child --spec attempt-NNN/spec.json

World size N > 1 (``resources.nproc_per_node``, carried in the attempt's ``Knobs.world_size``)::

    python -m torch.distributed.run --standalone --nproc-per-node N --max-restarts 0 \\
        --shutdown-timeout S -m qlora_supervise.trainer_child --spec attempt-NNN/spec.json

``--max-restarts 0``: retrying is the supervisor's job (with a new config when the failure says
so), not torchrun's (the same config again). ``--shutdown-timeout``: how long torchrun lets its
ranks checkpoint after the supervisor's SIGTERM before it kills them, the supervisor's own stop
grace (torchrun's default, 30 s, could cut a GPU checkpoint short). ``--standalone``: one host,
a rendezvous on a free local port. The spec path stays on the command line of torchrun and of
every rank, which is how reclaim finds the orphans of a supervisor that died.
"""

from __future__ import annotations

import sys
from pathlib import Path

from qlora_supervise.trainer_child.contract import entry
from qlora_supervise.trainer_child.contract.spec import AttemptSpec

TRAINER_MODULE = entry.ATTEMPT
MERGE_MODULE = entry.MERGE
#: torchrun's module: ``python -m torch.distributed.run`` is the ``torchrun`` entry point itself,
#: run with this interpreter, so the ranks import the same packages as a single child would.
TORCHRUN_MODULE = "torch.distributed.run"


def command(spec_path: Path, phase: str, world_size: int = 1, shutdown_timeout_s: float = 180.0) -> list[str]:
    """The argv of one attempt; ``world_size`` > 1 starts that many ranks through torchrun."""
    if phase == "merge":
        return [sys.executable, "-m", MERGE_MODULE, "--spec", str(spec_path)]
    child = ["-m", TRAINER_MODULE, "--spec", str(spec_path)]
    if world_size <= 1:
        return [sys.executable, *child]
    return [
        sys.executable,
        "-m",
        TORCHRUN_MODULE,
        "--standalone",
        "--nproc-per-node",
        str(world_size),
        "--max-restarts",
        "0",
        "--shutdown-timeout",
        str(max(1, round(shutdown_timeout_s))),
        *child,
    ]


def spec_command(spec_path: Path, phase: str) -> list[str]:
    """The argv for the spec written at ``spec_path``: its world size and stop grace decide.

    The runner writes the spec before it spawns, so the command and the spec cannot disagree; a
    spec that cannot be read starts one process, which then reports the spec as a config error.
    """
    try:
        spec = AttemptSpec.from_json(spec_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError, KeyError):
        return command(spec_path, phase)
    if spec.command and phase != "merge":  # a foreign trainer (supervisor/trainers/): its own argv
        return list(spec.command)
    return command(spec_path, phase, spec.knobs.world_size, spec.stop_grace_s)
