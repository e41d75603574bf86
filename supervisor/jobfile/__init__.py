"""The job file: its schema (validated once into the specs the child gets), units, world checks and the
data probe.

``load_job(path)`` returns a :class:`Job` or raises a :class:`JobError` listing every :class:`Problem`.
"""

from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.jobfile.load import load_job
from qlora_supervise.supervisor.jobfile.problems import JobError, Problem

__all__ = ["Job", "JobError", "Problem", "load_job"]
