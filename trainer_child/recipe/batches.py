"""The micro-batch in flight, for the report of a training step's OOM (issue 33).

The supervised Trainer remembers each micro-batch as it starts (its step, its index in the step,
each row's token count and leading tokens); after an OOM, :meth:`BatchTracker.in_flight` looks
its rows up in the training set, so the report can name the sample a repeating OOM is on.
"""

from __future__ import annotations

from typing import Any

from qlora_supervise.trainer_child.contract.attempt_facts import MAX_ROWS_SEARCHED, BatchInFlight

#: Leading tokens kept of each row of the micro-batch in flight, to find it in the training set.
ROW_KEY_TOKENS = 32


class BatchTracker:
    """The micro-batch a training step is on: step, index in the step, lengths, leading tokens."""

    def __init__(self) -> None:
        self._micro = 0
        self._batch: tuple[int, tuple[int, ...], list[list[int]]] | None = None

    def start(self, step: int, inputs: Any) -> None:
        """A micro-batch of optimizer step ``step`` (1-based) is about to train."""
        ids, mask = inputs["input_ids"], inputs.get("attention_mask")
        same_step = self._batch is not None and self._batch[0] == step
        self._micro = self._micro + 1 if same_step else 0
        rows = [row[m.bool()] for row, m in zip(ids, mask, strict=True)] if mask is not None else list(ids)
        lengths = tuple(int(row.numel()) for row in rows)
        self._batch = (step, lengths, [row[:ROW_KEY_TOKENS].tolist() for row in rows])

    def in_flight(self, dataset: Any) -> BatchInFlight | None:
        """The micro-batch in flight, its rows looked up in ``dataset`` (the training set)."""
        if self._batch is None:
            return None
        step, lengths, keys = self._batch
        return BatchInFlight(step, self._micro, lengths, find_rows(dataset, lengths, keys))


def find_rows(dataset: Any, lengths: tuple[int, ...], keys: list[list[int]]) -> tuple[int, ...] | None:
    """The indices of the rows with these lengths and leading tokens (-1: not found); None when the
    set cannot be searched (no ``input_ids`` column, packed, or above MAX_ROWS_SEARCHED rows)."""
    names = getattr(dataset, "column_names", None) or []
    if "input_ids" not in names or len(dataset) > MAX_ROWS_SEARCHED:
        return None
    wanted = {(length, tuple(key)): at for at, (length, key) in enumerate(zip(lengths, keys, strict=True))}
    found = [-1] * len(lengths)
    for index, row in enumerate(dataset["input_ids"]):
        position = wanted.get((len(row), tuple(row[:ROW_KEY_TOKENS])))
        if position is not None and found[position] < 0:
            found[position] = index
    return tuple(found)
