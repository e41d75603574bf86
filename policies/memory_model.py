"""The peak-memory model of a QLoRA attempt, and its per-run calibration.

It answers two questions: for ``qlora-supervise plan`` and the pre-flight, "what will this
config peak at, and where does the memory go?"; for the ladder, "can this candidate possibly
fit the budget?", so that rungs whose result would fail the same way are skipped.

The terms are in :mod:`.memory.gpu` (each one says what in the recipe and the libraries it
counts; the adapter's weights, gradients and optimizer state in :mod:`.memory.optimizer`), the
shape reader in :mod:`.memory.shape`, host memory in :mod:`.memory.host`. Against the H200 grid
(bench/results/memory-grid-h200-2026-12-01, re-scored by ``bench/models/score_memory_grid.py``): median
|error| 0.2 %, worst 2.2 % on peak allocated over 28 configs.

Calibration (:func:`calibrate`) splits a prediction into a *fixed* part (weights, embeddings,
adapter, optimizer state: exact byte counts) and a *variable* part (activations, the loss,
backward transients: they scale with tokens and are where the model's approximations live),
and fits one scale on the variable part from what the child reported. The next prediction for
a nearby config (same shape, other micro-batch / seq_len / checkpointing) is then
``fixed + scale * variable``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qlora_supervise.policies.memory.gpu import DEFAULT_TARGETS, Prediction, predict
from qlora_supervise.policies.memory.shape import ModelShape, Unsupported, UnsupportedReason
from qlora_supervise.trainer_child.contract.spec import Knobs

__all__ = [
    "DEFAULT_TARGETS",
    "UNCALIBRATED_MARGIN",
    "ModelShape",
    "Observation",
    "Prediction",
    "Unsupported",
    "UnsupportedReason",
    "calibrate",
    "cannot_fit",
    "estimate_peak",
    "predict",
    "split",
]

#: The parts that scale with tokens, which calibration corrects.
VARIABLE_COMPONENTS = frozenset(
    {"activations", "backward_block", "loss_hidden_fp32", "loss_tiles", "eval_activations"}
)
SCALE_RANGE = (0.25, 4.0)


def split(prediction: Prediction) -> tuple[int, int]:
    """(fixed, variable) bytes of a prediction's peak."""
    variable = sum(v for k, v in prediction.components.items() if k in VARIABLE_COMPONENTS)
    return prediction.peak_bytes - variable, variable


def estimate_peak(
    shape: ModelShape,
    knobs: Knobs,
    scale: float | None = None,
    targets: tuple[str, ...] | str = DEFAULT_TARGETS,
) -> int:
    """Predicted peak allocated bytes of training with ``knobs``; ``scale`` from :func:`calibrate`."""
    fixed, variable = split(predict(shape, knobs, targets))
    return fixed + int(variable * (1.0 if scale is None else scale))


@dataclass(frozen=True)
class Observation:
    """A peak the child reported (or the bytes an OOM needed) for the knobs it ran with."""

    knobs: Knobs
    peak_bytes: int
    exceeded: bool = False  # True: the attempt died needing *at least* this much


def calibrate(
    shape: ModelShape,
    observations: Sequence[Observation],
    targets: tuple[str, ...] | str = DEFAULT_TARGETS,
) -> float | None:
    """The scale on the variable part that explains the observed peaks; None without data.

    Only non-exceeded observations calibrate: an OOM tells a lower bound, not the peak. Each
    observation gives ``(observed - fixed) / variable``; the median keeps one odd attempt from
    steering the model. Clamped to [0.25, 4]: outside that the model is wrong in its fixed part,
    and a scale would only hide it.
    """
    scales = []
    for o in observations:
        if o.exceeded or not o.peak_bytes:
            continue
        fixed, variable = split(predict(shape, o.knobs, targets))
        if variable > 0:
            scales.append((o.peak_bytes - fixed) / variable)
    if not scales:
        return None
    scales.sort()
    low, high = SCALE_RANGE
    return min(high, max(low, scales[len(scales) // 2]))


UNCALIBRATED_MARGIN = 1.25


def cannot_fit(
    shape: ModelShape,
    knobs: Knobs,
    budget: int,
    scale: float | None,
    targets: tuple[str, ...] | str = DEFAULT_TARGETS,
) -> bool:
    """True when the calibrated prediction exceeds the budget, or the raw one exceeds it by 25 %."""
    if scale is None:
        return estimate_peak(shape, knobs, None, targets) > budget * UNCALIBRATED_MARGIN
    return estimate_peak(shape, knobs, scale, targets) > budget
