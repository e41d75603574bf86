"""The sample behind a repeating OOM: the same data position fails again (issue 33).

Our child names the micro-batch an OOM happened on, kept in the failure's numbers
(:data:`BATCH_KEYS`); :func:`repeat_note` says what a shorter ``max_seq_len`` would cost."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from qlora_supervise.policies.rungs import MIN_SEQ_LEN
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.trainer_child.contract.attempt_facts import BatchInFlight, SampleLengths

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
