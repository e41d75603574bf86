"""``qlora-supervise validate job.yaml``: every problem at once, or OK and a short summary."""

from __future__ import annotations

import contextlib
from pathlib import Path

from qlora_supervise.supervisor.commands import BadInput
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.jobfile import data_probe, hub
from qlora_supervise.supervisor.jobfile.advice import job_advice
from qlora_supervise.supervisor.jobfile.job import TRUST_REMOTE_CODE_WARNING, Job
from qlora_supervise.supervisor.jobfile.problems import JobError, Problem, show
from qlora_supervise.supervisor.record.rundir import foreign_output_dir
from qlora_supervise.supervisor.trainers.job import load_job
from qlora_supervise.supervisor.trainers.trainer import tool_advice, tool_problems


def validate_command(path: str) -> int:
    """Print ``<file>: OK`` and a summary (returns 0), or ``<file>: N problems`` and each one (2)."""
    try:
        job = load_job(path)
        problems = tool_problems(job.trainer)  # the tool itself, for the interpreter that runs it
        # output_dir as ``run`` would refuse it: a system folder, or someone else's files.
        if (found := foreign_output_dir(job.output_dir)) is not None:
            problems.append(Problem("output_dir", found[0], show(job.output_dir), found[1]))
        if problems:
            raise JobError(problems)
    except JobError as error:
        count = len(error.problems)
        print(f"{path}: {count} problem{'s' if count != 1 else ''}")
        for problem in error.problems:
            print(problem.render())
        return 2
    print(f"{path}: OK")
    records: int | None = None  # the training data's record count, for the warnings and the summary
    if job.trainer.probes_data():  # a tool reads its own data (a hub dataset, a mixture): not probed here
        messages = job.data.messages_field is not None
        name = job.data.messages_field if messages else job.data.text_field
        with contextlib.suppress(OSError, ValueError, data_probe.DataProbeError):
            records = data_probe.scan_records(Path(job.data.path), name or "", messages=messages)
    # What a person should know before running the job, though it is not a problem (jobfile.advice).
    trust = [f"warning: {TRUST_REMOTE_CODE_WARNING}"] if job.train.trust_remote_code else []
    advice = [found.render() for found in [*job_advice(job, records), *tool_advice(job.trainer)]]
    for line in [*trust, *advice, *summary_lines(job, records), *job.trainer.summary()]:
        print(f"  {line}")
    return 0


def load_or_exit(job_path: str, head: str | None = None, tail: str = "", tools: bool = False) -> Job:
    """The job (``tools``: its tool checked too), or exit 2: ``<job_path>: <head>:``, its problems, tail."""
    try:
        job = load_job(job_path)
        if tools and (problems := tool_problems(job.trainer)):
            raise JobError(problems)
        return job
    except JobError as error:
        lines = "\n".join(problem.render() for problem in error.problems)
        head = head or f"{len(error.problems)} problem(s)"
        raise BadInput(f"{job_path}: {head}:\n{lines}{tail}") from None


def summary_lines(job: Job, records: int | None = None) -> list[str]:
    """A few lines a person checks before starting a long run."""
    knobs, train, resources = job.knobs, job.train, job.resources
    model = hub.describe(knobs.model)
    if job.fallback_models:
        model += f" (fallbacks: {', '.join(job.fallback_models)})"
    ranks = f" x ranks {knobs.world_size}" if knobs.world_size > 1 else ""
    ranks += " (FSDP-QLoRA)" if knobs.fsdp else ""
    length = f"max_steps {train.max_steps}" if train.max_steps > 0 else f"{train.epochs:g} epoch(s)"
    # The data: records, not lines (blank lines are none).
    data, messages = job.data, job.data.messages_field is not None
    name = data.messages_field if messages else data.text_field
    count = "" if records is None else f"{records} records, "
    described = f"{data.path} ({count}{'messages_field' if messages else 'text_field'} {name!r})"
    if name is None:  # a foreign trainer's dataset: its own config says how to read it
        described = f"{data.path or '(see the trainer config)'} (read by the trainer itself)"
    caps = (("GPU", resources.gpu_memory_limit), ("CPU", resources.cpu_memory_limit))
    limits = [f"{name} {format_bytes(n)}" for name, n in caps if n is not None]
    return [
        f"model: {model}",
        f"data: {described}",
        f"effective batch: {knobs.effective_batch} = micro-batch {knobs.micro_batch_size} x accumulation "
        f"{knobs.grad_accum}{ranks}; seq_len {knobs.max_seq_len}; {length}",
        f"device: {resources.device}" + (f"; memory limits: {', '.join(limits)}" if limits else ""),
        f"output_dir: {job.output_dir}",
    ]
