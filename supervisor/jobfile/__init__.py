"""The job file: its schema, world checks and data probe. ``load_job(path)`` returns our trainer's
:class:`Job` or raises a :class:`JobError` listing every :class:`Problem` (a tool's job:
``trainers.job.load_job``)."""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from qlora_supervise.supervisor.jobfile.job import Job
    from qlora_supervise.supervisor.jobfile.load import load_job
    from qlora_supervise.supervisor.jobfile.problems import JobError, Problem

__all__ = ["Job", "JobError", "Problem", "load_job"]

# Re-exported lazily: importing a submodule must not load the schema and the world checks.
_HOMES = {"Job": "job", "load_job": "load", "JobError": "problems", "Problem": "problems"}


def __getattr__(name: str) -> object:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{_HOMES[name]}"), name)
