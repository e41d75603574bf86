"""What a memory give-up says about the cap: which one, the smallest peak seen or predicted,
what helps ("ladder exhausted" alone hides that the cap is too low)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies import memory_model
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.record.journal import AttemptRecord
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.spec import Knobs

CARD = "the card"
HOST_RAM = "the host's RAM"


@dataclasses.dataclass(frozen=True)
class Cap:
    """The memory limit the attempts ran under: the job field that set it (or the card), in bytes."""

    name: str  # "resources.gpu_memory_limit", "resources.cpu_memory_limit", CARD or HOST_RAM
    bytes: int | None  # None: the card, whose size the supervisor could not read


def cap_of(
    gpu_memory_limit: int | None, cpu_memory_limit: int | None, budget_bytes: int | None, device: str = "auto"
) -> Cap:
    """The job's GPU limit, else its CPU limit, else the host's RAM (on the CPU) or the card."""
    if gpu_memory_limit is not None:
        return Cap("resources.gpu_memory_limit", gpu_memory_limit)
    if cpu_memory_limit is not None:
        return Cap("resources.cpu_memory_limit", cpu_memory_limit)
    if device == "cpu":
        return Cap(HOST_RAM, None)
    return Cap(CARD, budget_bytes)


def cap_words(
    cap: Cap, records: Sequence[AttemptRecord], knobs: Knobs, shape: memory_model.ModelShape | None
) -> str:
    """One sentence for a memory give-up: the cap, the smallest peak seen or predicted, what helps."""
    limit = format_bytes(cap.bytes) if cap.bytes is not None else "its size unknown"
    parts = [f"the cap is {cap.name} ({limit})"]
    # The smallest peak an attempt reached (a failed one's is a lower bound of its step's need).
    seen = min((r.peak.bytes for r in records if r.peak is not None and r.peak.bytes), default=None)
    if seen is not None:
        parts.append(f"the smallest peak seen was {format_bytes(seen)}")
    if shape is not None:
        predicted = format_bytes(memory_model.estimate_peak(shape, knobs))
        parts.append(f"the memory model predicts {predicted} for the last config")
    raise_it = {CARD: "a card with more memory", HOST_RAM: "more host RAM"}.get(cap.name, f"raise {cap.name}")
    helps = "a smaller model in model.fallbacks, or a shorter train.max_seq_len"
    return "; ".join([*parts, f"what would help: {raise_it}, {helps}"])


def with_named_cap(
    decision: policy.GiveUp,
    kind: FailureKind,
    knobs: Knobs,
    job: Job,
    settings: policy.Settings,
    records: Sequence[AttemptRecord],
) -> policy.GiveUp:
    """A memory give-up with the cap named; others (and contention: no cap is to blame) as they were."""
    if not kind.is_oom or kind is FailureKind.OOM_CONTENTION:
        return decision
    res = job.resources
    cap = cap_of(res.gpu_memory_limit, res.cpu_memory_limit, settings.budget_bytes, res.device)
    words = cap_words(cap, records, knobs, settings.shape)
    return dataclasses.replace(decision, why=f"{decision.why}; {words}")
