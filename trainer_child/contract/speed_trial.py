"""The speed trial's contract: the candidates the supervisor hands the child, and what it found.

Before step 1 of an attempt whose spec lists :class:`TrialCandidate` s, the child times a few
forward+backward micro-steps of each on its longest real batch, in-process, without reloading
the model and without an optimizer step, then trains with the fastest (switching only for a clear
gain). It reports the table as one ``speed_trial`` event (:class:`SpeedTrialEvent`); the
supervisor journals it and takes the chosen knobs as the attempt's.

Only knobs that change without a reload are candidates: the micro-batch (with the accumulation
that keeps the effective batch) and gradient checkpointing. In a foreign tool's process the shim
runs the same trial on the tool's Trainer; where it cannot (no tokenized dataset to take a row
from, axolotl's sample packing), the event says why (``abandoned``) and the plan stays.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping, Sequence
from typing import ClassVar

#: A candidate replaces the planned config only when it is this much faster (DeepSpeed's
#: autotuner also keeps the first config within noise); below it the trial's noise decides.
MIN_GAIN = 0.05


@dataclasses.dataclass(frozen=True)
class TrialCandidate:
    """One config the trial times: the knobs that change without a reload, and the planner's guess."""

    micro_batch_size: int
    grad_accum: int
    gradient_checkpointing: bool
    predicted_tokens_per_s: float | None = None
    predicted_peak_bytes: int | None = None
    predicted_host_bytes: int | None = None  # its training host peak (the host model's; None: unplanned)

    @classmethod
    def from_json(cls, raw: Mapping[str, object]) -> TrialCandidate | None:
        micro, accum = _int(raw.get("micro_batch_size")), _int(raw.get("grad_accum"))
        checkpointing = raw.get("gradient_checkpointing")
        if micro is None or accum is None or not isinstance(checkpointing, bool):
            return None
        return cls(
            micro,
            accum,
            checkpointing,
            _float(raw.get("predicted_tokens_per_s")),
            _int(raw.get("predicted_peak_bytes")),
            _int(raw.get("predicted_host_bytes")),
        )


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

    @classmethod
    def from_json(cls, raw: Mapping[str, object]) -> TrialResult | None:
        candidate = raw.get("candidate")
        parsed = TrialCandidate.from_json(candidate) if isinstance(candidate, Mapping) else None
        seconds = _float(raw.get("seconds"))
        if parsed is None or seconds is None:
            return None
        error = raw.get("error")
        return cls(parsed, _float(raw.get("tokens_per_s")), _int(raw.get("peak_bytes")), seconds,
                   error if isinstance(error, str) else None, _int(raw.get("host_peak_bytes")))  # fmt: skip


@dataclasses.dataclass(frozen=True)
class SpeedTrialEvent:
    """The ``speed_trial`` line of the child's events file."""

    event: ClassVar[str] = "speed_trial"
    results: tuple[TrialResult, ...]
    chosen: TrialCandidate
    switched: bool  # the chosen candidate is not the first (the planned config)
    seconds: float  # the trial's whole cost, before step 1
    # Why the trial stopped short and kept the plan, in a foreign tool's process (its data or its
    # Trainer is not one the trial can time, trainer_child/shim/trial.py); None: it ran.
    abandoned: str | None = None

    def to_json(self) -> dict[str, object]:
        return {"event": self.event, **dataclasses.asdict(self)}

    def to_line(self) -> str:
        """The line of the child's events file (with its ``time`` stamp, which ``from_json`` ignores)."""
        return json.dumps({**self.to_json(), "time": time.time()}) + "\n"

    @classmethod
    def from_json(cls, raw: Mapping[str, object]) -> SpeedTrialEvent | None:
        rows = raw.get("results")
        chosen = raw.get("chosen")
        seconds = _float(raw.get("seconds"))
        if not isinstance(rows, list) or not isinstance(chosen, Mapping) or seconds is None:
            return None
        results = tuple(r for r in (TrialResult.from_json(x) for x in rows if isinstance(x, Mapping)) if r)
        picked = TrialCandidate.from_json(chosen)
        if picked is None or len(results) != len(rows):
            return None
        abandoned = raw.get("abandoned")
        why = abandoned if isinstance(abandoned, str) else None
        return cls(results, picked, bool(raw.get("switched")), seconds, why)


def choose(results: Sequence[TrialResult]) -> TrialCandidate:
    """The candidate to train with: the first (the planned config) unless another measured more than
    :data:`MIN_GAIN` faster. A first that failed (an OOM, or a peak over the plan's limit: its
    ``error``) gives way to the fastest that ran within it; when none did, the first stays (training
    then fails as it would have without a trial, and the ladder acts).
    """
    first = results[0]
    ran = [r for r in results if r.tokens_per_s is not None and r.error is None]
    if not ran:
        return first.candidate
    fastest = max(ran, key=lambda r: r.tokens_per_s or 0.0)
    if first not in ran or not first.tokens_per_s:  # it failed (an OOM, or over the plan's limit)
        return fastest.candidate
    gain = (fastest.tokens_per_s or 0.0) / first.tokens_per_s - 1
    return fastest.candidate if gain > MIN_GAIN else first.candidate


def within(result: TrialResult, limit: int | None) -> TrialResult:
    """``result``, or the same marked dropped when it measured above ``limit``: the pre-flight would
    not have planned a config it knew peaked there (on the H200 a calibrated plan once predicted
    10.0 GiB for a config the trial measured at 11.6 under a 12 GiB cap: 4 % from an OOM)."""
    if limit is None or result.peak_bytes is None or result.error is not None or result.peak_bytes <= limit:
        return result
    gib = 1 << 30
    why = f"measured peak {result.peak_bytes / gib:.2f} GiB is over the plan's limit {limit / gib:.2f} GiB"
    return dataclasses.replace(result, error=why)


def _float(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _int(value: object) -> int | None:
    return int(value) if isinstance(value, int) and not isinstance(value, bool) else None
