"""What ``validate`` says about a foreign trainer, and the job as ``install-systemd`` copies it."""

from __future__ import annotations

from typing import Any

import yaml

from qlora_supervise.supervisor.jobfile.advice import Advice
from qlora_supervise.supervisor.jobfile.job import Job
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


def renamed_advice(trainer: ForeignTrainer | None) -> list[Advice]:
    """A warning for each old key name the tool would drop without a word (its value then unused)."""
    if trainer is None:
        return []
    where = trainer.config_path.name if trainer.config_path is not None else "trainer.command"
    return [
        Advice(
            f"{where}: {old}",
            f"{trainer.kind.value} no longer reads {old} and drops it silently, so it runs with "
            f"{new}'s value (or its default) instead",
            f"rename it to {new}" + (f" (both are set: delete {old})" if new in trainer.config else ""),
        )
        for old, new in trainer.table.renamed.items()
        if old in trainer.config
    ]


def foreign_job_copy(job: Job, raw: dict[str, Any]) -> str:
    """The job with its paths absolute (the copy lives in another directory); the tool still runs
    in the folder it ran in, so the relative paths inside its config keep their meaning."""
    trainer = job.trainer
    assert trainer is not None
    section = raw["trainer"]
    if trainer.config_path is not None:
        section["config"] = str(trainer.config_path)
    if "python" in section:
        section["python"] = trainer.python
    section["workdir"] = str(trainer.workdir or job.job_file.parent)
    raw["output_dir"] = str(job.output_dir)
    header = f"# installed by qlora-supervise install-systemd from {job.job_file}\n"
    return header + yaml.safe_dump(raw, sort_keys=False)
