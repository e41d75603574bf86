"""What is wrong with a job file, in words: a :class:`Problem` per mistake (field path, the bad
value as the job file spells it, the fix), all raised at once in a :class:`JobError`."""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable
from pathlib import Path

from pydantic_core import PydanticCustomError

FILE_PATH = "<job file>"  # the field path of problems with the file as a whole
#: The pydantic error type of :func:`job_error`; its ctx carries ``problem`` and ``fix``.
JOB_ERROR_TYPE = "job"


@dataclasses.dataclass(frozen=True)
class Problem:
    """One thing wrong with a job file. ``got`` is the bad value as shown to people (None: missing)."""

    path: str
    problem: str
    got: str | None
    fix: str

    def render(self) -> str:
        """``  train.micro_batch_size: must be > 0 (got 0; use a value > 0)``"""
        got = "missing" if self.got is None else f"got {self.got}"
        detail = f"{got}; {self.fix}" if self.fix else got
        return f"  {self.path}: {self.problem} ({detail})"


class JobError(Exception):
    """The job file cannot be used; ``problems`` lists every reason at once."""

    def __init__(self, problems: list[Problem]) -> None:
        super().__init__("\n".join(p.render() for p in problems))
        self.problems = problems


def job_error(problem: str, fix: str) -> PydanticCustomError:
    """The error a validator raises: the problem and its fix travel apart in ctx."""
    return PydanticCustomError(JOB_ERROR_TYPE, "{problem}", {"problem": problem, "fix": fix})


def show(value: object) -> str:
    """A value as the job file would spell it, cut to one short line."""
    text = repr(str(value) if isinstance(value, Path) else value)
    if value is None or isinstance(value, bool):
        text = "null" if value is None else str(value).lower()
    return text if len(text) <= 80 else text[:77] + "..."


def did_you_mean(word: object, choices: Iterable[str], label: str = "allowed") -> str:
    """``did you mean 'micro_batch_size'?`` when one choice is close, else ``allowed: <choices>``."""
    options = sorted(choices)
    if close := difflib.get_close_matches(str(word), options, n=1, cutoff=0.6):
        return f"did you mean {close[0]!r}?"
    return f"{label}: " + (", ".join(options) or "none")
