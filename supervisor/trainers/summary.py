"""A tool's job as ``install-systemd`` copies it."""

from __future__ import annotations

from typing import Any

import yaml

from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.trainers.trainer import ToolTrainer


def tool_job_copy(job: Job, raw: dict[str, Any]) -> str:
    """The job with its paths absolute (the copy lives in another directory); the tool still runs
    in the folder it ran in, so the relative paths inside its config keep their meaning."""
    trainer = job.trainer
    if not isinstance(trainer, ToolTrainer):
        raise TypeError("not a tool's job")  # install_systemd asks only for a tool's
    section = raw["trainer"]
    if trainer.config_path is not None:
        section["config"] = str(trainer.config_path)
    if "python" in section:
        section["python"] = trainer.python
    section["workdir"] = str(trainer.workdir or job.job_file.parent)
    raw["output_dir"] = str(job.output_dir)
    header = f"# installed by qlora-supervise install-systemd from {job.job_file}\n"
    return header + yaml.safe_dump(raw, sort_keys=False)
