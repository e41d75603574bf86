"""The speed trial's contract: the candidates the supervisor hands the child, and what it measured.

Before step 1 of an attempt whose spec lists :class:`TrialCandidate` s, the child times a few
forward+backward micro-steps of each on its longest real batch, in-process, without reloading
the model and without an optimizer step. It reports the timings as one ``speed_trial`` event
(:class:`SpeedTrialEvent`); which one trains is the policy's (``policies.choice.after_trial``),
which the child applies in-process and the supervisor journals from the same timings.

Only knobs that change without a reload are candidates: the micro-batch (with the accumulation
that keeps the effective batch) and gradient checkpointing. In a foreign tool's process the shim
runs the same trial on the tool's Trainer; where it cannot (no tokenized dataset to take a row
from, axolotl's sample packing), the event says why (``abandoned``) and the plan stays.
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
    predicted_host_bytes: int | None = None  # its training host peak (the host model's; None: unplanned)

    @property
    def name(self) -> str:
        checkpointing = ", checkpointing" if self.gradient_checkpointing else ""
        return f"micro-batch {self.micro_batch_size} x {self.grad_accum}{checkpointing}"


@dataclasses.dataclass(frozen=True)
class TrialResult:
    """A candidate's measurement: tokens/s and peak, or the OOM that dropped it (``error``);
    ``host_peak_bytes``: the child's RSS high-water mark while it was timed (None: not readable)."""

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
    # Why the trial stopped short and kept the plan, in a foreign tool's process (its data or its
    # Trainer is not one the trial can time, trainer_child/shim/trial.py); None: it ran.
    abandoned: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"event": self.event, **dataclasses.asdict(self)}

    def to_line(self) -> str:
        """The line of the child's events file (with its ``time`` stamp, which the reader ignores)."""
        return json.dumps({**self.to_json(), "time": time.time()}) + "\n"
