"""The plan's inputs: the job file and the model's files, each refused in the job's own words
(exit 2), as ``run`` would refuse them."""

from __future__ import annotations

from dataclasses import dataclass

from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.supervisor.facts.trainer import OWN
from qlora_supervise.supervisor.jobfile import Job, JobError, model_files
from qlora_supervise.supervisor.trainers.job import load_job
from qlora_supervise.trainer_child.contract.spec import Knobs


def load_plan_job(job_path: str) -> Job:
    """The job, or exit 2 with every problem listed."""
    try:
        return load_job(job_path)
    except JobError as error:
        lines = "\n".join(problem.render() for problem in error.problems)
        raise SupervisorExit(
            SupervisorExitCode.BAD_JOB, f"{job_path}: {len(error.problems)} problem(s):\n{lines}"
        ) from None


def plan_model_files(model: str, job: Job) -> model_files.ModelFiles:
    """The model's files, or exit 2 naming the model in the job's own words."""
    try:
        return model_files.read_model_files(model)
    except model_files.ModelFilesError as error:
        raise SupervisorExit(SupervisorExitCode.BAD_JOB, _in_the_jobs_words(str(error), model, job)) from None


def _in_the_jobs_words(message: str, model: str, job: Job) -> str:
    """The model as the job names it: ``model.path``, or a tool's own key in its config."""
    key, where, spelled = job.trainer.model_words()
    if not model:
        return (
            f"the job names no model ({key} is not set in {where}): plan reads the model's config.json "
            f"to predict its memory; add {spelled} there"
        )
    return message.replace("point model.path at", f"point {key} (in {where}) at")


@dataclass(frozen=True)
class JobView:
    """What the plan reads of a job (the one place that knows the Job API)."""

    knobs: Knobs
    targets: tuple[str, ...] | str
    fallbacks: tuple[str, ...]
    calibration_store: bool
    gpu_memory_limit: int | None
    cpu_memory_limit: int | None
    device: str
    host_memory_limit: int | None
    merge: bool
    cannot_take: frozenset[str] = frozenset()  # rungs a foreign tool's config has no key for
    trainer: str = OWN  # whose speeds on this host rank the candidates (the per-host store)
