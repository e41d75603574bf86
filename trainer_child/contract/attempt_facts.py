"""Facts the child reports once per attempt, each as its own JSON object under its own key:
:class:`SampleLengths` in ``loaded``, :class:`RankReduction` in ``resumed``, :class:`BatchInFlight`
in the error report of an OOM in a training step."""

from __future__ import annotations

import dataclasses
from typing import Any

from pydantic import TypeAdapter, ValidationError

#: Most sample lengths one ``loaded`` event carries; a larger training set is sampled evenly.
MAX_REPORTED_LENGTHS = 2000


@dataclasses.dataclass(frozen=True)
class SampleLengths:
    """Tokenized lengths of the training samples before truncation, sorted: every sample up to
    ``MAX_REPORTED_LENGTHS`` rows, else an evenly spaced sample (counts from it are estimates)."""

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
    """A resumed adapter cut to a smaller rank by truncated SVD: the share of the update's energy
    kept, over all modules and in the module that keeps least."""

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
    """The micro-batch a training step ran out of memory on: ``rows`` are the training set's indices
    of its ``lengths`` (None: packed, or above :data:`MAX_ROWS_SEARCHED` rows; -1: not found)."""

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
        """The same step and a row in common (rows unknown: a longest row of the same length); the
        next rungs change the micro index and the other lengths while the same row fails."""
        if self.step != other.step:
            return False
        mine, theirs = ({row for row in rows or () if row >= 0} for rows in (self.rows, other.rows))
        if mine and theirs:
            return not mine.isdisjoint(theirs)
        return bool(self.lengths) and max(self.lengths) == max(other.lengths, default=-1)
