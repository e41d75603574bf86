"""The policy's view of a job: its budgets, fallbacks, overrides, the model's shape and its data's lengths."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.memory.host import host_train_need
from qlora_supervise.policies.memory_model import ModelShape
from qlora_supervise.policies.search.budget import card_budget, host_budget
from qlora_supervise.policies.search.throughput import SpeedObservation
from qlora_supervise.policies.verdicts import for_model
from qlora_supervise.supervisor.jobfile import model_files
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.record import peak_store
from qlora_supervise.supervisor.record.history import AttemptSpeed, trial_speeds
from qlora_supervise.supervisor.record.journal import AttemptRecord, Phase
from qlora_supervise.supervisor.record.peak_store import read_observations, read_speeds
from qlora_supervise.supervisor.trainers import model_facts
from qlora_supervise.supervisor.watching import host as host_memory
from qlora_supervise.supervisor.watching.gpu import GpuProbe
from qlora_supervise.trainer_child.contract.events import ChildEvent, Loaded, ScriptKnobs
from qlora_supervise.trainer_child.contract.spec import Knobs


def policy_settings(job: Job) -> policy.Settings:
    """Settings from the job alone; the budget is the job's GPU cap. None on the CPU: the memory
    model predicts GPU allocations, not the child's data segment; the ladder's order decides there."""
    resources, supervise = job.resources, job.supervise
    budget = None if resources.device == "cpu" else resources.gpu_memory_limit
    unmodelled = job.trainer.unmodelled(job.knobs.model)
    model = Path(job.knobs.model)  # its shape as its trainer runs it (a foreign tool's attention choice)
    shape = None if unmodelled else model_facts.with_tool_attention(model_shape(model), job.trainer)
    store, kind = peak_store_path(job), job.trainer.kind
    prior = tuple(read_observations(store, shape, kind)) if store is not None and shape is not None else ()
    speeds = tuple(read_speeds(store, shape, kind)) if store is not None and shape is not None else ()
    # The host budget: ``resources.host_memory_limit``, else the RAM available now (capped by the
    # cgroup) less a reserve; None on the CPU or without a shape to count with.
    host = None
    if shape is not None and resources.device != "cpu":
        try:
            files = model_files.read_model_files(job.knobs.model)
            checkpoint, shard = files.checkpoint_bytes, files.largest_shard_bytes
        except model_files.ModelFilesError:
            checkpoint, shard = None, 0
        free, cgroup = host_memory.host_room()  # through the module: the tests' one seam
        limit = resources.host_memory_limit
        host = host_budget(checkpoint or shape.params * 2, free, cgroup, limit, largest_shard_bytes=shard)
    return policy.Settings(
        max_attempts=supervise.max_attempts,
        max_no_progress=supervise.max_no_progress_attempts,
        degrade_on_contention=supervise.degrade_on_contention,
        step_up=supervise.step_up,
        step_up_settle_s=supervise.step_up_settle,
        step_up_quality=supervise.step_up_quality,
        contention_wait_s=supervise.contention_wait,
        disk_wait_s=supervise.disk_wait,
        fallbacks=job.fallback_models,
        # A tool takes only the rungs its config can express (supervisor/trainers/trainer.py).
        overrides=job.trainer.ladders(supervise.ladders),
        budget_bytes=budget,
        shape=shape,
        unmodelled=unmodelled,
        prior=prior,
        speeds=speeds,
        fallback_shapes=tuple((model, model_shape(Path(model))) for model in job.fallback_models),
        speed_trial=supervise.speed_trial,  # in our child, or the shim in a foreign tool (shim/session.py)
        cannot_take=job.trainer.cannot_take(),
        host=host,
        targets=job.train.target_modules,
    )


def predicted_host(settings: policy.Settings, knobs: Knobs) -> int | None:
    """The host model's training-phase host peak for ``knobs`` (None: no shape or host budget)."""
    own = for_model(settings, knobs.model)  # a fallback model's own shape
    if own.shape is None or own.host is None:
        return None
    return host_train_need(own.shape, knobs, own.host.checkpoint_bytes, own.targets).train_peak


def remember_attempt(
    settings: policy.Settings, job: Job, record: AttemptRecord, speed: AttemptSpeed
) -> policy.Settings:
    """After a journalled training attempt that finished a step: its peak and tokens/s into the
    per-host store (best effort: a cache), and its tokens/s into this run's settings."""
    if record.phase is not Phase.TRAIN or record.steps_progressed <= 0:
        return settings
    store, shape = peak_store_path(job), settings.shape
    trial = trial_speeds(speed, record.knobs)
    if store is not None and shape is not None:
        # The trial's candidates first, then the attempt's own line, which wins for its knobs; under
        # torchrun the peak only (the ranks' tokens/s is no one card's speed).
        kind, peak = job.trainer.kind, record.peak.bytes if record.peak else None
        for knobs, rate in trial:
            peak_store.record_attempt(store, shape, knobs, None, rate, kind)
        if record.knobs.world_size == 1:
            peak_store.record_attempt(store, shape, speed.knobs, peak, speed.tokens_per_s, kind)
        elif peak is not None:
            peak_store.record_attempt(store, shape, record.knobs, peak, None, kind)
    observed = [SpeedObservation(knobs, rate) for knobs, rate in trial]
    if speed.tokens_per_s is not None:  # newest last: a config measured twice counts its latest
        observed.append(SpeedObservation(speed.knobs, speed.tokens_per_s))
    return dataclasses.replace(settings, speeds=(*settings.speeds, *observed))


def peak_store_path(job: Job) -> Path | None:
    """The per-host peak store, or None: turned off, or a CPU run (its peaks are no GPU's)."""
    if not job.supervise.calibration_store or job.resources.device == "cpu":
        return None
    return peak_store.default_path()


def with_card_budget(settings: policy.Settings, gpu: GpuProbe | None) -> policy.Settings:
    """Without a cap, the budget is the card's total from NVML less a reserve."""
    if settings.budget_bytes is not None or gpu is None:
        return settings
    if (sample := gpu.sample(set())) is None or not sample.total:
        return settings
    return dataclasses.replace(settings, budget_bytes=card_budget(sample.total))


def with_sample_lengths(settings: policy.Settings, events: Sequence[ChildEvent]) -> policy.Settings:
    """The sample lengths of the attempt's ``loaded`` event into the settings (none: unchanged)."""
    for event in reversed(events):
        if isinstance(event, Loaded) and event.sample_lengths is not None:
            return dataclasses.replace(settings, sample_lengths=event.sample_lengths)
    return settings


def with_script_model(settings: policy.Settings, events: Sequence[ChildEvent]) -> policy.Settings:
    """A script's model shape, from its attempt's ``script_knobs``, when the job named none readable."""
    if settings.shape is not None:
        return settings
    for event in reversed(events):
        if isinstance(event, ScriptKnobs) and event.model_config:
            shape = ModelShape.from_config(event.model_config)
            return settings if shape is None else dataclasses.replace(settings, shape=shape, unmodelled=None)
    return settings


def model_shape(model_dir: Path) -> ModelShape | None:
    try:
        return ModelShape.from_config(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return None
