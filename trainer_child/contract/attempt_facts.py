"""Facts the child reports once per attempt, typed on both sides of the events file.

Standard library only (the supervisor reads them): :class:`SampleLengths` travels in the
``loaded`` event, :class:`RankReduction` in the ``resumed`` event, :class:`BatchInFlight` in the
error report of an OOM in a training step. Each writes its fields with
``fields()`` and is read back with ``from_fields()``, which returns None for an event written
before the field existed (or a torn one), so old events files stay readable.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

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

    def fields(self) -> dict[str, Any]:
        return {"sample_lengths": {"rows": self.rows, "lengths": list(self.lengths)}}

    @classmethod
    def from_fields(cls, raw: Mapping[str, Any]) -> SampleLengths | None:
        value = raw.get("sample_lengths")
        if not isinstance(value, Mapping):
            return None
        rows, lengths = value.get("rows"), value.get("lengths")
        if not isinstance(rows, int) or not isinstance(lengths, list) or not all(map(_is_int, lengths)):
            return None
        if isinstance(rows, bool) or rows <= 0 or not lengths or len(lengths) > rows:
            return None
        return cls(rows, tuple(sorted(lengths)))


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

    @classmethod
    def from_fields(cls, raw: Mapping[str, Any]) -> RankReduction | None:
        value = raw.get("rank_reduction")
        if not isinstance(value, Mapping):
            return None
        try:
            reduction = cls(**{f.name: value[f.name] for f in dataclasses.fields(cls)})
        except (KeyError, TypeError):
            return None
        ints = (reduction.rank_from, reduction.rank_to, reduction.modules)
        floats = (reduction.energy_kept, reduction.worst_energy_kept)
        if not all(map(_is_int, ints)) or not all(isinstance(x, int | float) for x in floats):
            return None
        return reduction


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

    def to_json_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json_dict(cls, raw: object) -> BatchInFlight | None:
        """The batch a report names; None for anything ill-typed (a torn or older report)."""
        if not isinstance(raw, Mapping):
            return None
        step, micro, lengths, rows = (raw.get(key) for key in ("step", "micro", "lengths", "rows"))
        if not isinstance(step, int) or not isinstance(micro, int) or isinstance(step, bool):
            return None
        if not isinstance(lengths, list) or not all(map(_is_int, lengths)):
            return None
        if rows is not None and not (isinstance(rows, list) and all(map(_is_int, rows))):
            return None
        if rows is not None and len(rows) != len(lengths):
            return None  # a row index per length, or the record is corrupt
        return cls(step, micro, tuple(lengths), tuple(rows) if rows is not None else None)

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


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
