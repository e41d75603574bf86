"""``qlora-supervise plan JOB [--gpu-memory 24GiB] [--host-memory 32GiB] [--json]``: where the memory
will go, on the card and on the host, before training (docs/planning.md). No GPU, no torch, no weights.
The card, first match wins: ``--gpu-memory`` (budget: the size less the CUDA context and a paged
optimizer's state, both outside PyTorch's allocator), the job's ``gpu_memory_limit`` (budget: the cap
itself, since it caps the allocator), NVML. The host, first match wins: ``--host-memory`` (less a
reserve), ``resources.host_memory_limit``, the RAM available now (capped by the cgroup, less a
reserve); every candidate must fit it too. ``--json``: schema ``qlora-supervise.plan/1``. Exit 0 when
the plan was made, 6 (as ``run`` would) when nothing fits, 2 for a bad job file, an unreadable model
directory or a bad size flag. The text view is plan_text.py's."""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TextIO

from qlora_supervise.policies import choice, memory_model
from qlora_supervise.policies.memory import gpu as gpu_terms
from qlora_supervise.policies.memory import host as host_terms
from qlora_supervise.policies.memory.shape import ModelShape, Unsupported, UnsupportedReason, resolve_targets
from qlora_supervise.policies.rungs import knob_changes
from qlora_supervise.policies.search import throughput
from qlora_supervise.policies.search.budget import HostBudget, card_budget, card_reserve, host_budget
from qlora_supervise.policies.search.search_state import PreflightResult, rung_effects
from qlora_supervise.supervisor.commands import BadInput
from qlora_supervise.supervisor.commands.plan_text import render
from qlora_supervise.supervisor.commands.validate import load_or_exit
from qlora_supervise.supervisor.exit_codes import SupervisorExitCode
from qlora_supervise.supervisor.facts.units import UnitError, format_bytes, parse_memory_size
from qlora_supervise.supervisor.jobfile import Job, model_files
from qlora_supervise.supervisor.loop.planner import UNMODELLED_RUN, nothing_fits_text
from qlora_supervise.supervisor.loop.settings import model_shape, peak_store_path
from qlora_supervise.supervisor.record.peak_store import read_speeds
from qlora_supervise.supervisor.trainers import model_facts
from qlora_supervise.supervisor.watching import host as watched_host
from qlora_supervise.supervisor.watching.gpu import GpuMonitor, visible_gpu_count
from qlora_supervise.trainer_child.contract.spec import Knobs

SCHEMA = "qlora-supervise.plan/1"


@dataclass(frozen=True)
class Card:
    source: str  # flag, job_cap, nvml, none
    total_bytes: int | None
    free_bytes: int | None
    reserve_bytes: int
    reserve_why: str
    budget_bytes: int | None


def plan_command(
    job_path: str,
    gpu_memory: str | None = None,
    as_json: bool = False,
    out: TextIO | None = None,
    host_memory: str | None = None,
) -> int:
    out = out or sys.stdout  # read at the call: a captured stdout is the one to print to
    plan = make_plan(job_path, gpu_memory, host_memory=host_memory)
    print(json.dumps(plan, indent=2) if as_json else "\n".join(render(plan)), file=out)
    start = plan["start"]
    # As `run` would end before any child: exit 6 (the plan itself is printed either way).
    return int(SupervisorExitCode.NOTHING_FITS) if start and start["nothing_fits"] is not None else 0


def make_plan(job_path: str, gpu_memory: str | None, host_memory: str | None = None) -> dict[str, Any]:
    """The plan as the JSON object (schema: docs/planning.md)."""
    job = load_or_exit(job_path)
    knobs = job.trainer.built_knobs(job.knobs, job.output_dir)  # a script's: as it built them
    targets, cannot_take = job.train.target_modules, job.trainer.cannot_take()  # as `run` leaves them out
    host_size = size_flag("--host-memory", host_memory)
    files = plan_model_files(knobs.model, job)
    # The shape as the trainer runs it (a foreign tool's attention), or why the memory model cannot count
    # it (a foreign tool's 8-bit or unquantized weights: run starts as written).
    read = ModelShape.read(files.config)
    if (why := job.trainer.unmodelled(job.knobs.model)) is not None:
        read = Unsupported(UnsupportedReason.NOT_MODELLED, f"{why}: {UNMODELLED_RUN}")
    elif isinstance(read, ModelShape):
        read = model_facts.with_tool_attention(read, job.trainer) or read
    shape = read if isinstance(read, ModelShape) else None
    gone = read if isinstance(read, Unsupported) else None
    as_written = None if shape is None else memory_model.predict(shape, knobs, targets)
    card = find_card(gpu_memory, job, as_written)
    checkpoint = files.checkpoint_bytes or (shape.params * 2 if shape else None)
    room = watched_host.host_room()  # (available, cgroup limit), read once; the tests' one seam
    host = None
    if checkpoint is not None and job.resources.device != "cpu":  # on the CPU cpu_memory_limit caps it
        limit = job.resources.host_memory_limit
        host = host_budget(checkpoint, *room, limit, host_size, files.largest_shard_bytes)
    start = speed = None
    # This host's measured speeds of the shape (the per-host store), unless turned off.
    if shape is not None and (store := peak_store_path(job)) is not None:
        speeds = read_speeds(store, shape, job.trainer.kind)
        speed = throughput.calibrate(shape, speeds, job.train.target_modules) if speeds else None
    if shape is not None and (budget := card.budget_bytes) is not None:
        fallbacks = tuple((model, model_shape(Path(model))) for model in job.fallback_models)
        start = choice.first(
            shape,
            knobs,
            budget,
            targets=targets,
            speed=speed,
            fallbacks=fallbacks,
            unusable=cannot_take,
            host=host,
        )
    effects = [] if shape is None else rung_effects(shape, knobs, targets, speed=speed)
    # What the shape reader found of the architecture, modelled or not (None: a model type it does not
    # read); ``missing_terms``: what the memory model would need for it.
    facts, architecture = ModelShape.architecture(files.config), None
    if not isinstance(facts, Unsupported):
        terms = list(facts.missing_terms())
        architecture = {**asdict(facts), "summary": facts.describe(), "missing_terms": terms}
    rungs = [
        {
            "name": r.name,
            "cost_class": r.cost_class.value,
            "cost": r.cost,
            "tokens_per_s": None if r.tokens_per_s is None else round(r.tokens_per_s, 1),
            "peak_bytes": r.predicted_peak,
            "changes": {k: list(v) for k, v in r.changes.items()},
        }
        for r in effects
        if r.name not in cannot_take
    ]
    ranking = [
        {
            "rank": n,
            "tokens_per_s": round(c.tokens_per_s, 1),
            "measured": c.measured,
            "peak_bytes": c.peak_bytes,
            "host_peak_bytes": c.host_peak_bytes,
            "cost_class": c.cost_class.value,
            "rungs": list(c.rungs),
            "changes": {k: list(v) for k, v in knob_changes(knobs, c.knobs).items()},
        }
        for n, c in enumerate(() if start is None else start.ranking, start=1)
    ]
    return {
        "schema": SCHEMA,
        "job": str(Path(job_path).absolute()),
        "model": knobs.model,
        "peak_bytes": None if as_written is None else as_written.peak_bytes,
        "components": {} if as_written is None else dict(as_written.components),
        "shape": None if shape is None else {**asdict(shape), "params": shape.params},
        "unsupported": None if gone is None else {"reason": gone.reason.value, "detail": gone.detail},
        "architecture": architecture,
        "notes": list(files.notes) + _tie_note(files, shape),
        "targets": list(resolve_targets(targets, shape.model_type if shape else "llama")),
        "as_written": None if as_written is None else {
            "knobs": asdict(knobs), **asdict(as_written), "card_bytes": as_written.card_bytes
        },
        "card": asdict(card),
        "fits_as_written": None if start is None else start.fits_as_written,
        "start": None if start is None else _start(start),
        "ranking": ranking,
        "rungs": rungs,
        "host": {
            **host_ram(checkpoint, files.largest_shard_bytes, job, room),
            **host_training(shape, knobs, targets, host, start),
        },
    }  # fmt: skip


def find_card(gpu_memory: str | None, job: Job, predicted: gpu_terms.Prediction | None) -> Card:
    """The card and the budget, in the module docstring's order."""
    paged = 0 if predicted is None else predicted.outside.get("paged_optimizer_state", 0)
    reserve = card_reserve(paged)
    why = f"CUDA context {format_bytes(gpu_terms.CUDA_CONTEXT)} (outside PyTorch's allocator)"
    if paged:
        why += f" + paged optimizer state {format_bytes(paged)} (unified memory, outside the allocator)"
    total = size_flag("--gpu-memory", gpu_memory)  # a bare 24 is refused: it would be 24 bytes
    if total is not None:
        return Card("flag", total, None, reserve, why, card_budget(total, paged))
    if (cap := job.resources.gpu_memory_limit) is not None:
        cap_why = "none: gpu_memory_limit caps PyTorch's allocator, and the peak allocated is what it caps"
        return Card("job_cap", cap, None, 0, cap_why, cap)
    if job.resources.device != "cpu" and (monitor := GpuMonitor.open(job.resources.device)) is not None:
        with contextlib.closing(monitor):
            sample = monitor.sample(set())
        if sample is not None:
            return Card("nvml", sample.total, sample.free, reserve, why, card_budget(sample.total, paged))
    return Card("none", None, None, reserve, why, None)


def _start(r: PreflightResult) -> dict[str, Any]:
    return {
        "knobs": asdict(r.knobs),
        "changes": {k: list(v) for k, v in r.changes.items()},
        "reasons": list(r.reasons),
        "quality_changed": r.quality_changed,
        "fits": r.fits,
        "margin": r.margin,
        "peak_bytes": r.predicted.peak_bytes,
        "components": dict(r.predicted.components),
        "tokens_per_s": None if r.tokens_per_s is None else round(r.tokens_per_s, 1),
        "fallback": r.fallback,
        "speed_trial": [asdict(c) for c in r.speed_trial],
        "host_peak_bytes": r.host_peak_bytes,
        "nothing_fits": None if r.nothing_fits is None else {
            "smallest_peak_bytes": r.nothing_fits.smallest_peak,
            "budget_bytes": r.nothing_fits.budget_bytes,
            "help": r.nothing_fits.help,
            "message": nothing_fits_text(r),
            "host": r.nothing_fits.host,
        },
    }  # fmt: skip


def plan_model_files(model: str, job: Job) -> model_files.ModelFiles:
    """The model's files, or exit 2 naming the model as the job does (``model.path``, or a tool's key)."""
    try:
        return model_files.read_model_files(model)
    except model_files.ModelFilesError as error:
        key, where, spelled = job.trainer.model_words()
        if not model:
            why = f"plan reads the model's config.json to predict its memory; add {spelled} there"
            message = f"the job names no model ({key} is not set in {where}): {why}"
        else:
            message = str(error).replace("point model.path at", f"point {key} (in {where}) at")
        raise BadInput(message) from None


def _tie_note(files: model_files.ModelFiles, shape: ModelShape | None) -> list[str]:
    if shape is None or (has_head := files.has_lm_head) is None or has_head != shape.tie_word_embeddings:
        return []
    if has_head:
        return ["config says tie_word_embeddings but the checkpoint stores lm_head.weight: counted as tied"]
    return ["the checkpoint has no lm_head.weight but config says untied: transformers will create one"]


def size_flag(flag: str, value: str | None) -> int | None:
    """A size flag's bytes; a bad one is a bad command line (exit 2), named."""
    if value is None:
        return None
    try:
        return parse_memory_size(value)
    except UnitError as error:
        raise BadInput(f"{flag} {value!r}: {error}") from None


def host_training(
    shape: ModelShape | None,
    knobs: Knobs,
    targets: tuple[str, ...] | str,
    host: HostBudget | None,
    start: PreflightResult | None,
) -> dict[str, Any]:
    """The host budget and the start's (else ``knobs``') training host peak by component, with its basis."""
    need = None
    if shape is not None and host is not None:
        knobs, shard = knobs if start is None else start.knobs, host.largest_shard_bytes
        need = host_terms.host_train_need(shape, knobs, host.checkpoint_bytes, targets, shard)
    rejected, smallest = (0, None) if start is None else start.host_rejected
    return {
        "budget_bytes": None if host is None else host.budget_bytes,
        "budget_source": None if host is None else host.source,
        "reserve_bytes": 0 if host is None else host.reserve_bytes,
        "train_peak_bytes": None if need is None else need.peak_bytes,
        "train_phase": None if need is None else need.phase,
        "train_phase_bytes": None if need is None else need.train_peak,
        "train_components": {} if need is None else dict(need.train_components),
        "train_basis": "" if need is None else need.basis,
        "rejected": rejected,
        "rejected_smallest_bytes": smallest,
    }


def host_ram(
    checkpoint: int | None, largest_shard: int, job: Job, host_room: tuple[int, int | None]
) -> dict[str, Any]:
    """The load's and the merge's host RAM (RSS, the mapped checkpoint included), and whether the load's
    need (imports + its largest shard) fits the smallest of available, cgroup limit, cpu_memory_limit."""
    available, limit = host_room
    resources = job.resources
    on_gpu = resources.device != "cpu" and bool(visible_gpu_count())  # gpu: auto on a CPU host is a CPU run
    need = None if checkpoint is None else host_terms.host_need(checkpoint, largest_shard, on_gpu)
    rooms = {"available": available, "cgroup limit": limit, "cpu_memory_limit": resources.cpu_memory_limit}
    room_of, room = min(((k, v) for k, v in rooms.items() if v is not None), key=lambda kv: kv[1])
    imports = host_terms.IMPORTS_RSS if on_gpu else host_terms.CPU_IMPORTS_RSS
    return {
        "checkpoint_bytes": checkpoint,
        "load_peak_bytes": None if need is None else need.load_peak,
        "merge_peak_bytes": None if need is None else need.merge_peak,
        "available_bytes": available,
        "cgroup_limit_bytes": limit,
        "basis": "" if need is None else need.basis,
        "load_fits": None if checkpoint is None else imports + (largest_shard or checkpoint) <= room,
        "room_bytes": room,
        "room_of": room_of,
    }
