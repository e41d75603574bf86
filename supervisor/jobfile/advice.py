"""Warnings (``validate`` prints them, ``run`` says them at start): jobs that validate and would run
but probably do not mean what they say. A problem stops the job; advice does not."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import BeforeValidator

from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.jobfile.schema import SuperviseSection, to_seconds
from qlora_supervise.supervisor.jobfile.world import split_sizes
from qlora_supervise.supervisor.watching.gpu import visible_gpu_count


@dataclass(frozen=True)
class Advice:
    """One warning: the job file's field, what it will do, and what to write instead."""

    field: str
    what: str
    fix: str

    def render(self) -> str:
        return f"warning: {self.field}: {self.what}; {self.fix}"


def job_advice(
    job: Job, records: int | None, gpu_count: Callable[[], int | None] = visible_gpu_count
) -> list[Advice]:
    """Every warning for ``job``; ``records``: the training file's record count (None: unknown)."""
    try:
        raw = yaml.safe_load(job.raw_text)
    except yaml.YAMLError:
        raw = {}
    raw = raw if isinstance(raw, dict) else {}
    found = _bare_durations(raw)
    train = raw.get("train")
    if isinstance(train, dict) and train.get("max_steps") is not None and train.get("epochs") is not None:
        steps = job.train.max_steps
        what = f"both max_steps ({steps}) and epochs ({train['epochs']}) are set: max_steps wins"
        found.append(Advice("train.epochs", what, "remove epochs (or max_steps, to train by epochs)"))
    found += _split_advice(job, records)
    device = job.resources.device
    if not device.startswith("cuda:"):
        return found
    index, visible = int(device.removeprefix("cuda:")), gpu_count()
    if visible is not None and index < visible:
        return found
    seen = f"{visible} GPU(s) visible" if visible else "no NVIDIA GPU is visible here (NVML finds no driver)"
    what = f"{device}: {seen}; the trainer would fail after loading its libraries"
    fix = "run it on the GPU machine, check CUDA_VISIBLE_DEVICES, or set gpu: cpu (or auto)"
    return [*found, Advice("resources.gpu", what, fix)]


def _bare_durations(raw: dict[str, Any]) -> list[Advice]:
    supervise = raw.get("supervise")
    if not isinstance(supervise, dict):
        return []
    found: list[Advice] = []
    for name, info in SuperviseSection.model_fields.items():
        if not any(isinstance(m, BeforeValidator) and m.func is to_seconds for m in info.metadata):
            continue  # not a duration (its type reads ``20m``)
        value = supervise.get(name)
        text = str(value).strip()
        if isinstance(value, bool) or not re.fullmatch(r"\d+(\.\d*)?|\.\d+", text) or float(text) == 0:
            continue
        what = f"{text} has no unit and is read as {text} seconds"
        found.append(Advice(f"supervise.{name}", what, f"write {text}s (or {text}m if you meant minutes)"))
    return found


def _split_advice(job: Job, records: int | None) -> list[Advice]:
    fraction = job.data.eval_fraction
    if records is None or fraction == 0 or job.data.eval_path is not None:
        return []
    train_rows, eval_rows = split_sizes(records, fraction)
    batch = job.knobs.effective_batch
    if train_rows >= batch:
        return []
    what = (
        f"{fraction:g} of {records} record(s) holds out all {eval_rows}: the trainer will refuse to start"
        if train_rows == 0
        else f"{fraction:g} of {records} record(s) trains on {train_rows} and evaluates on {eval_rows}: "
        f"fewer than one effective batch ({batch}), so every step repeats the same records"
    )
    return [Advice("data.eval_fraction", what, "use more data, a smaller eval_fraction or a data.eval_path")]
