"""The policy's view of a job: its budgets, fallbacks, overrides and the model's shape."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.budget import card_budget
from qlora_supervise.policies.memory_model import ModelShape
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.watching.gpu import GpuProbe


def policy_settings(job: Job) -> policy.Settings:
    """Settings from the job alone; the budget is the job's cap (the CPU cap on the CPU)."""
    resources = job.resources
    budget = resources.gpu_memory_limit
    if budget is None and resources.device == "cpu":
        budget = resources.cpu_memory_limit
    supervise = job.supervise
    return policy.Settings(
        max_attempts=supervise.max_attempts,
        max_no_progress=supervise.max_no_progress_attempts,
        degrade_on_contention=supervise.degrade_on_contention,
        contention_wait_s=supervise.contention_wait,
        disk_wait_s=supervise.disk_wait,
        fallbacks=job.fallback_models,
        overrides=dict(supervise.ladders),
        budget_bytes=budget,
        shape=model_shape(Path(job.knobs.model)),
    )


def with_card_budget(settings: policy.Settings, gpu: GpuProbe | None) -> policy.Settings:
    """Without a cap, the budget is the card's total from NVML less a reserve."""
    if settings.budget_bytes is not None or gpu is None:
        return settings
    sample = gpu.sample(set())
    if sample is None or not sample.total:
        return settings
    return dataclasses.replace(settings, budget_bytes=card_budget(sample.total))


def model_shape(model_dir: Path) -> ModelShape | None:
    try:
        return ModelShape.from_config(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None
