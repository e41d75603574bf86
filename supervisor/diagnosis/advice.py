"""What a memory failure's decision says to people. A give-up names the cap (which one, the smallest peak seen
or predicted, what helps: "ladder exhausted" alone hides that the cap is too low). A repeating OOM names its
sample (issue 33): our child names the micro-batch an OOM happened on, kept in the failure's numbers
(:data:`BATCH_KEYS`); :func:`repeat_note` says what a shorter ``max_seq_len`` would cost."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies import memory_model
from qlora_supervise.policies.rungs import MIN_SEQ_LEN
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.record.journal import AttemptRecord
from qlora_supervise.trainer_child.contract.attempt_facts import BatchInFlight, SampleLengths
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


BATCH_KEYS = ("batch_step", "batch_micro", "batch_lengths", "batch_rows")


def batch_numbers(batch: BatchInFlight) -> dict[str, Any]:
    """The failure's numbers for ``batch``."""
    rows = {"batch_rows": list(batch.rows)} if batch.rows is not None else {}
    head = {"batch_step": batch.step, "batch_micro": batch.micro}
    return {**head, "batch_lengths": list(batch.lengths), **rows}


def batch_of(numbers: Mapping[str, Any]) -> BatchInFlight | None:
    """The micro-batch a failure's numbers name, or None."""
    raw = {key.removeprefix("batch_"): numbers.get(key) for key in BATCH_KEYS}
    return BatchInFlight.from_json_dict(raw) if raw["step"] is not None else None


def describe(batch: BatchInFlight) -> str:
    """``step 7, micro-batch 2: rows 4812 (3904 tokens), 77 (512 tokens)``."""
    rows = batch.rows or (-1,) * len(batch.lengths)
    named = [
        f"row {row} ({length} tokens)" if row >= 0 else f"a row of {length} tokens"
        for row, length in sorted(zip(rows, batch.lengths, strict=True), key=lambda item: -item[1])
    ]
    return f"step {batch.step}, micro-batch {batch.micro}: {', '.join(named)}"


def repeat_note(
    failure: Failure, before: Failure | None, max_seq_len: int, lengths: SampleLengths | None
) -> str | None:
    """The sentence for an OOM at the data position the attempt before failed at too; else None."""
    this = batch_of(failure.numbers)
    last = batch_of(before.numbers) if before is not None else None
    if this is None or last is None or not this.same_position(last):
        return None
    head = f"the OOM repeats at the same data position ({describe(this)})"
    return f"{head}; {_seq_len_cost(this, max_seq_len, lengths)}"


def _seq_len_cost(batch: BatchInFlight, max_seq_len: int, lengths: SampleLengths | None) -> str:
    shorter = max(MIN_SEQ_LEN, max_seq_len // 2)
    longest = max(batch.lengths)
    if shorter >= longest or lengths is None:
        what = "would cut none of these rows" if shorter >= longest else "cost unknown (no sample lengths)"
        return f"max_seq_len {shorter} {what}"
    cut = [length for length in lengths.lengths if length > shorter]
    scale = lengths.rows / len(lengths.lengths)
    rows_cut = round(len(cut) * scale)
    # The reported lengths are before truncation: what max_seq_len already cut is no new loss.
    tokens = round(sum(min(length, max_seq_len) - shorter for length in cut) * scale)
    mine = sum(1 for length in batch.lengths if length > shorter)
    about = "" if lengths.exact else "about "
    if rows_cut <= mine:
        only = f"only these {mine} row(s) ({about}{tokens} tokens)"
        return f"max_seq_len {shorter} would cut {only}: removing or splitting them keeps everything else"
    lost = f"{about}{rows_cut} of {lengths.rows} rows ({tokens} tokens)"
    return f"max_seq_len {shorter} would cut {lost}, not only these {mine}"
