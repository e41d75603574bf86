"""What ``validate`` says about a foreign trainer: the tool, its config, the keys the ladder may set."""

from __future__ import annotations

from qlora_supervise.supervisor.trainers.foreign import ForeignTrainer
from qlora_supervise.supervisor.trainers.tables import rungs_for, writable


def foreign_lines(trainer: ForeignTrainer) -> list[str]:
    source = trainer.config_path if trainer.config_path is not None else "the flags of trainer.command"
    rungs = rungs_for(trainer.table, trainer.config)
    keys = ", ".join(
        row.key for row in trainer.table.rows if row.knob != "model" and writable(row, trainer.config)
    )
    return [
        f"trainer: {trainer.kind.value}, config {source} (read once; never modified: each attempt "
        f"writes its own copy into attempt-NNN/)",
        f"keys the ladder may set: {keys}; {trainer.table.output_key} and {trainer.table.resume_key} "
        "are set for every attempt; every other key is passed through",
        f"rungs: {', '.join(sorted(rungs))} (the others change what this tool cannot be told, so its "
        "ladders leave them out)",
    ]
