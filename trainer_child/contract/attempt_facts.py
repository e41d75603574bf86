"""Facts the child reports once per attempt, typed on both sides of the events file.

:class:`SampleLengths` travels in the
``loaded`` event, :class:`RankReduction` in the ``resumed`` event, :class:`BatchInFlight` in the
error report of an OOM in a training step. Each travels as its own JSON object under its own key,
read back by the pydantic codecs of the event and the report.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import TypeAdapter, ValidationError

#: Most sample lengths one ``loaded`` event carries; a larger training set is sampled evenly.
MAX_REPORTED_LENGTHS = 2000


@dataclasses.dataclass(frozen=True)
class SampleLengths:
    """Tokenized lengths of the training samples, before any truncation to ``max_seq_len``.

    ``lengths`` is sorted; it holds every sample when ``rows <= MAX_REPORTED_LENGTHS``, else an
    evenly spaced sample of them (then counts derived from it are estimates, scaled to ``rows``).
    """

    rows: int
    lengths: tuple[int, ...]

    @property
    def exact(self) -> bool:
        return len(self.lengths) == self.rows

    def __post_init__(self) -> None:
        object.__setattr__(self, "lengths", tuple(sorted(self.lengths)))

    def fields(self) -> dict[str, Any]:
        return {"sample_lengths": dataclasses.asdict(self)}


@dataclasses.dataclass(frozen=True)
class RankReduction:
    """A resumed adapter cut to a smaller rank by truncated SVD of its trained update.

    ``energy_kept`` is the share of the update's energy (sum of squared singular values of
    ``delta_W = scale * B @ A``) the smaller rank keeps, over all modules together;
    ``worst_energy_kept`` that of the module that keeps least (``worst_module``).
    """

    rank_from: int
    rank_to: int
    modules: int
    energy_kept: float
    worst_energy_kept: float
    worst_module: str

    def fields(self) -> dict[str, Any]:
        return {"rank_reduction": dataclasses.asdict(self)}


#: Most training rows the child searches for the rows of a micro-batch that ran out of memory.
MAX_ROWS_SEARCHED = 50_000


@dataclasses.dataclass(frozen=True)
class BatchInFlight:
    """The micro-batch a training step was on when it ran out of memory: its data position and rows.

    ``step`` is the optimizer step being trained (the last completed one + 1), ``micro`` the
    micro-batch's index within it; ``lengths`` the rows' token counts (after the recipe's
    truncation to ``max_seq_len``); ``rows`` their indices in the training set, in the same
    order, where the child found them (None: packed sequences, or a set above
    :data:`MAX_ROWS_SEARCHED` rows; an index is -1 where a row was not found).
    """

    step: int
    micro: int
    lengths: tuple[int, ...]
    rows: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.rows is not None and len(self.rows) != len(self.lengths):
            raise ValueError("a row index per length, or the record is corrupt")

    @classmethod
    def from_json_dict(cls, raw: object) -> BatchInFlight | None:
        """The batch a report's or a failure's numbers name; None for anything ill-typed."""
        try:
            return TypeAdapter(cls).validate_python(raw)
        except ValidationError:
            return None

    def same_position(self, other: BatchInFlight) -> bool:
        """Whether ``other`` is this data position again: the same optimizer step and a row in
        common (where either side's rows are unknown, a longest row of the same length).

        The micro-batch's index and the other rows' lengths are not compared: the usual next rungs
        (a smaller micro-batch, a shorter ``max_seq_len``) change them while the same row fails at
        the same step.
        """
        if self.step != other.step:
            return False
        mine, theirs = _found(self.rows), _found(other.rows)
        if mine and theirs:
            return not mine.isdisjoint(theirs)
        return bool(self.lengths) and max(self.lengths) == max(other.lengths, default=-1)


def _found(rows: tuple[int, ...] | None) -> frozenset[int]:
    """The row indices the child found (-1: a row it did not find)."""
    return frozenset(row for row in rows or () if row >= 0)
