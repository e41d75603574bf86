"""The policy's view of a job: its budgets, fallbacks, overrides, the model's shape and its data's lengths."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.budget import card_budget
from qlora_supervise.policies.memory_model import ModelShape
from qlora_supervise.supervisor.diagnosis.fragmentation import StepFit, predicted_fit
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.record.peak_store import default_path, read_observations
from qlora_supervise.supervisor.record.records import Phase
from qlora_supervise.supervisor.watching.gpu import GpuProbe
from qlora_supervise.trainer_child.contract.attempt_facts import SampleLengths


def policy_settings(job: Job) -> policy.Settings:
    """Settings from the job alone; the budget is the job's GPU cap.

    On the CPU there is no budget: the memory model predicts GPU allocations, not the child's
    data segment (which starts at the import baseline of torch and the stack), so comparing it
    with ``cpu_memory_limit`` would skip or pick rungs for the wrong reason; the ladder's order
    decides there.
    """
    resources = job.resources
    budget = None if resources.device == "cpu" else resources.gpu_memory_limit
    supervise = job.supervise
    shape = model_shape(Path(job.knobs.model))
    store = peak_store_path(job)
    prior = tuple(read_observations(store, shape)) if store is not None and shape is not None else ()
    return policy.Settings(
        max_attempts=supervise.max_attempts,
        max_no_progress=supervise.max_no_progress_attempts,
        degrade_on_contention=supervise.degrade_on_contention,
        contention_wait_s=supervise.contention_wait,
        disk_wait_s=supervise.disk_wait,
        fallbacks=job.fallback_models,
        overrides=dict(supervise.ladders),
        budget_bytes=budget,
        shape=shape,
        prior=prior,
    )


def peak_store_path(job: Job) -> Path | None:
    """The per-host peak store, or None: turned off, or a CPU run (its peaks are no GPU's)."""
    if not job.supervise.calibration_store or job.resources.device == "cpu":
        return None
    return default_path()


def with_card_budget(settings: policy.Settings, gpu: GpuProbe | None) -> policy.Settings:
    """Without a cap, the budget is the card's total from NVML less a reserve."""
    if settings.budget_bytes is not None or gpu is None:
        return settings
    sample = gpu.sample(set())
    if sample is None or not sample.total:
        return settings
    return dataclasses.replace(settings, budget_bytes=card_budget(sample.total))


def with_sample_lengths(settings: policy.Settings, events: Sequence[Mapping[str, Any]]) -> policy.Settings:
    """The sample lengths of the attempt's ``loaded`` event into the settings (unchanged when the
    attempt reported none, e.g. it failed while loading: the earlier attempt's lengths stay)."""
    for event in reversed(events):
        lengths = SampleLengths.from_fields(event) if event.get("event") == "loaded" else None
        if lengths is not None:
            return dataclasses.replace(settings, sample_lengths=lengths)
    return settings


def model_shape(model_dir: Path) -> ModelShape | None:
    try:
        return ModelShape.from_config(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None


def step_fit(settings: policy.Settings, device: str, plan: Plan) -> StepFit | None:
    """The memory model's training peak for the plan's knobs against the GPU budget. None for a
    merge (the model predicts training) and on the CPU (the model counts GPU memory; a CPU run's
    budget, its data segment cap, is not comparable)."""
    if plan.phase is not Phase.TRAIN or device == "cpu":
        return None
    return predicted_fit(settings.shape, plan.knobs, settings.budget_bytes)
