"""What the pre-flight returns: the ranked candidates, the verdict when nothing fits, the choice."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from qlora_supervise.policies.memory.gpu import Prediction
from qlora_supervise.policies.rungs import CostClass
from qlora_supervise.trainer_child.contract.spec import Knobs, TrialCandidate


@dataclass(frozen=True)
class Ranked:
    """One fitting candidate: its knobs, the rungs it takes, predicted peak and tokens/s."""

    knobs: Knobs
    rungs: tuple[str, ...]
    peak_bytes: int
    tokens_per_s: float
    measured: bool  # tokens/s from this host's or run's measurements (else the model's)
    cost_class: CostClass  # the dearest class among its rungs (free with none)
    host_peak_bytes: int | None = None  # its training host peak (None: no host budget to plan with)


@dataclass(frozen=True)
class NothingFits:
    """No config of the job's model, nor of a fallback, is predicted to fit."""

    smallest_peak: int
    smallest_knobs: Knobs
    budget_bytes: int
    margin: float
    help: str
    host: bool = False  # True: host memory is what nothing fits (the figures are the host's)


@dataclass(frozen=True)
class PreflightResult:
    """The knobs attempt 1 should run with, and why."""

    knobs: Knobs
    predicted: Prediction
    fits_as_written: bool
    changes: dict[str, tuple[Any, Any]]
    reasons: tuple[str, ...]
    quality_changed: bool
    fits: bool  # False: nothing the pre-flight may change is predicted to fit (see nothing_fits)
    budget_bytes: int
    margin: float
    cost: float  # predicted share of tokens/s lost against the job as written (negative: faster)
    tokens_per_s: float | None = None  # predicted (or measured) for ``knobs``
    ranking: tuple[Ranked, ...] = ()  # every fitting candidate of the chosen model, fastest first
    speed_trial: tuple[TrialCandidate, ...] = ()  # for the child to time; empty: nothing to choose
    fallback: str | None = None  # the fallback model started instead of the job's
    nothing_fits: NothingFits | None = None
    host_peak_bytes: int | None = None  # the chosen config's training host peak
    # Candidates that fit the card but not the host: how many, and the smallest host need of them.
    host_rejected: tuple[int, int | None] = (0, None)


def knob_changes(old: Knobs, new: Knobs) -> dict[str, tuple[Any, Any]]:
    """``{knob: (old, new)}`` for every knob that differs."""
    before, after = dataclasses.asdict(old), dataclasses.asdict(new)
    return {name: (before[name], after[name]) for name in before if before[name] != after[name]}


def gib(value: float) -> str:
    return f"{value / (1 << 30):.2f} GiB"
