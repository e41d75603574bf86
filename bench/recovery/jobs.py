"""The job file every approach starts from, and the attempt spec the bare approaches run.

One job per scenario and run directory, as a user would write it; only three lines are the
bench's own: ``stop_grace`` (a run cut by the bench's deadline stops within seconds, not the
default 3 minutes), ``calibration_store: false`` (each run starts uncalibrated: card commands
running together would otherwise calibrate each other's pre-flight through the host's store) and,
when this installation's schema has it, ``warm_spare`` for the variants that set it.

The restart loop and ``auto_find_batch_size`` run the same job without the supervisor: their
spec is built from the validated :class:`Job` exactly as the supervisor's runner builds attempt
1's (same knobs, data, recipe settings, caps and device), with ``resume_from`` the loop's choice.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING

from .scenarios import UNCAPPED, Scenario

if TYPE_CHECKING:
    from qlora_supervise.trainer_child.contract.spec import AttemptSpec

#: supervise.warm_spare as each supervised variant sets it (None: the job leaves the default).
SPARE_SETTING = {
    "supervised": None,
    "supervised-spare": True,  # the overhead runs: a spare beside them on any host
    "as-written": True,
    "as-written-no-spare": False,
}


def has_warm_spare_field() -> bool:
    """Whether the installed job schema knows ``supervise.warm_spare`` (the spare's merge)."""
    from qlora_supervise.supervisor.jobfile.schema import SuperviseSection

    return "warm_spare" in SuperviseSection.model_fields


def job_text(s: Scenario, assets: Path, run_dir: Path, tiny: bool, warm_spare: bool | None) -> str:
    """The job file of ``s`` (paths absolute); ``warm_spare`` is written only when not None."""
    limit = "" if s.card == UNCAPPED else f", {'cpu' if tiny else 'gpu'}_memory_limit: {s.card}"
    resources = f"{{gpu: {'cpu' if tiny else 0}{limit}}}"
    spare = "" if warm_spare is None else f", warm_spare: {str(warm_spare).lower()}"
    gc = str(s.gradient_checkpointing).lower()
    return f"""\
model: {{path: {assets / "model"}}}
data: {{path: {assets / s.data_name}, text_field: text}}
lora: {{r: {s.r}, alpha: {2 * s.r}, target_modules: [q_proj, k_proj, v_proj, o_proj]}}
train:
  max_seq_len: {s.seq}
  micro_batch_size: {s.micro}
  effective_batch_size: {s.effective_batch}
  gradient_checkpointing: {gc}
  optimizer: {s.optimizer}
  max_steps: {s.max_steps}
  save_steps: {s.save_steps}
  logging_steps: 1
resources: {resources}
supervise: {{stop_grace: 20s, calibration_store: false{spare}}}
output_dir: {run_dir}
"""


def write_job(s: Scenario, assets: Path, run_dir: Path, tiny: bool, warm_spare: bool | None = None) -> Path:
    """``run_dir``'s job file, beside the run directory (the supervisor copies it inside)."""
    path = run_dir.with_name(run_dir.name + ".yaml")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(job_text(s, assets, run_dir, tiny, warm_spare), encoding="utf-8")
    return path


def job_spec(job_file: Path) -> AttemptSpec:
    """Attempt 1's spec of the job as written (no rung, no pre-flight), not yet placed."""
    from qlora_supervise.supervisor.jobfile import load_job
    from qlora_supervise.trainer_child.contract.spec import AttemptSpec

    job = load_job(job_file)
    resources = job.resources
    return AttemptSpec(
        *(1, str(job.output_dir), job.knobs, job.data, job.train, "", "", "", "", ""),
        device=resources.device,
        gpu_memory_limit=resources.gpu_memory_limit,
        cpu_memory_limit=resources.cpu_memory_limit,
        diagnose=job.diagnose,
    )


def placed(spec: AttemptSpec, run_dir: Path, number: int, resume_from: Path | None) -> AttemptSpec:
    """``spec`` as attempt ``number`` in ``run_dir`` (the supervisor's layout), resuming from
    ``resume_from`` (None: step 0), with its optimizer state as saved."""
    attempt_dir = run_dir / f"attempt-{number:03d}"
    return dataclasses.replace(
        spec,
        attempt=number,
        run_dir=str(run_dir),
        events_file=str(attempt_dir / "child-events.jsonl"),
        error_file=str(attempt_dir / "error.json"),
        checkpoints_dir=str(run_dir / "checkpoints"),
        adapter_dir=str(run_dir / "adapter"),
        merged_dir=str(run_dir / "merged"),
        resume_from=str(resume_from) if resume_from else None,
        reset_optimizer=False,
    )
