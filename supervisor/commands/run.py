"""``qlora-supervise run job.yaml``: load the job once, lock its run directory, run the loop."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, TextIO

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.memory_model import ModelShape
from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.supervisor.jobfile.job import Job, JobError, load_job
from qlora_supervise.supervisor.loop.arbiter import Seams, Supervisor
from qlora_supervise.supervisor.record.eventlog import open_event_log
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.reporting import notify
from qlora_supervise.trainer_child.durable import write_text_atomic


def run_job(
    job_path: str,
    plain: bool = False,
    seams: Seams | None = None,
    console: TextIO = sys.stderr,
    install_signals: bool = True,
) -> int:
    """Supervise ``job_path`` to a verdict; returns the exit code (see ``--help``)."""
    job = _load(job_path)
    run_dir = RunDir(job.output_dir)
    lock = run_dir.lock()
    try:
        log = open_event_log(run_dir.events, console)
        _keep_job_copy(run_dir, job, log)
        supervisor = Supervisor(job, run_dir, log, seams, console, plain, policy_settings(job))
        if install_signals:
            supervisor.install_signal_handlers()
        notify.ready()
        code = supervisor.run()
        notify.stopping()
        return code
    finally:
        lock.close()


def _load(job_path: str) -> Job:
    try:
        return load_job(job_path)
    except JobError as error:
        lines = "\n".join(problem.render() for problem in error.problems)
        raise SupervisorExit(
            SupervisorExitCode.BAD_JOB,
            f"{job_path}: {len(error.problems)} problem(s):\n{lines}\n"
            f"(run `qlora-supervise validate {job_path}`)",
        ) from None


def _keep_job_copy(run_dir: RunDir, job: Job, log: Any) -> None:
    previous = run_dir.job_copy.read_text(encoding="utf-8") if run_dir.job_copy.exists() else None
    if previous is not None and previous != job.raw_text:
        # The first submission stays beside the new one so the journal's early attempts stay explained.
        keep = run_dir.root / "job.previous.yaml"
        write_text_atomic(keep, previous)
        log.warning("job_changed", kept_previous=str(keep))
    write_text_atomic(run_dir.job_copy, job.raw_text)


def policy_settings(job: Job) -> policy.Settings:
    """The policy's view of the job: budgets, fallbacks, overrides, and the model's shape."""
    budget = job.gpu_memory_limit_bytes
    if budget is None and job.device == "cpu":
        budget = job.cpu_memory_limit_bytes
    return policy.Settings(
        max_attempts=job.supervise.max_attempts,
        max_no_progress=job.supervise.max_no_progress_attempts,
        degrade_on_contention=job.supervise.degrade_on_contention,
        contention_wait_s=job.contention_wait_s,
        fallbacks=job.fallback_models,
        overrides=job.ladder_overrides(),
        budget_bytes=budget,
        shape=_model_shape(Path(job.first_knobs().model)),
    )


def _model_shape(model_dir: Path) -> ModelShape | None:
    try:
        return ModelShape.from_config(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None
