"""The speed trial's contract: the candidates the supervisor hands the child, and what it measured.

Before step 1 the child times a few forward+backward micro-steps of each :class:`TrialCandidate`
on its longest real batch, in-process, and reports them in one ``speed_trial`` event; the policy
(``policies.choice.after_trial``) picks from the same timings on both sides. Only knobs that change
without a reload are candidates: the micro-batch (with its accumulation) and checkpointing.
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import ClassVar


@dataclasses.dataclass(frozen=True)
class TrialCandidate:
    """One config the trial times: the knobs that change without a reload, and the planner's guess."""

    micro_batch_size: int
    grad_accum: int
    gradient_checkpointing: bool
    predicted_tokens_per_s: float | None = None
    predicted_peak_bytes: int | None = None
    predicted_host_bytes: int | None = None  # the host model's training peak (None: unplanned)

    @property
    def name(self) -> str:
        checkpointing = ", checkpointing" if self.gradient_checkpointing else ""
        return f"micro-batch {self.micro_batch_size} x {self.grad_accum}{checkpointing}"


@dataclasses.dataclass(frozen=True)
class TrialResult:
    """A candidate's tokens/s and peak, or the OOM that dropped it (``error``); ``host_peak_bytes``:
    the child's RSS high-water mark while it was timed."""

    candidate: TrialCandidate
    tokens_per_s: float | None
    peak_bytes: int | None
    seconds: float
    error: str | None = None
    host_peak_bytes: int | None = None


@dataclasses.dataclass(frozen=True)
class SpeedTrialEvent:
    """The ``speed_trial`` line of the child's events file."""

    event: ClassVar[str] = "speed_trial"
    results: tuple[TrialResult, ...]  # the first is the planned config
    seconds: float  # the trial's whole cost, before step 1
    # Why a foreign tool's trial kept the plan (shim/trial.py); None: it ran.
    abandoned: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"event": self.event, **dataclasses.asdict(self)}

    def to_line(self) -> str:
        """The line of the child's events file (its ``time`` stamp ignored by the reader)."""
        return json.dumps({**self.to_json(), "time": time.time()}) + "\n"
