"""The peak-memory model of a QLoRA attempt (terms in :mod:`.memory.gpu`), and its calibration.
Calibration splits a prediction into a *fixed* part (exact byte counts: weights, adapter, optimizer
state) and a *variable* part (what scales with tokens, where the approximations live) and fits one
scale on the variable part from observed peaks."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from qlora_supervise.policies.memory.gpu import DEFAULT_TARGETS, Prediction, predict
from qlora_supervise.policies.memory.shape import ModelShape, Targets
from qlora_supervise.trainer_child.contract.spec import Knobs

#: The terms' names the callers read through this module (its own are public as defined).
__all__ = ["DEFAULT_TARGETS", "ModelShape", "Prediction", "predict"]
VARIABLE_COMPONENTS = frozenset(
    {"activations", "backward_block", "loss_hidden_fp32", "loss_tiles", "eval_activations"}
)
SCALE_RANGE = (0.25, 4.0)


def split(prediction: Prediction) -> tuple[int, int]:
    """(fixed, variable) bytes of a prediction's peak."""
    variable = sum(v for k, v in prediction.components.items() if k in VARIABLE_COMPONENTS)
    return prediction.peak_bytes - variable, variable


def scaled_peak(prediction: Prediction, scale: float | None) -> int:
    """The allocated peak with the variable part scaled by a calibration (None: as predicted)."""
    fixed, variable = split(prediction)
    return prediction.peak_bytes if scale is None else fixed + int(variable * scale)


def estimate_peak(
    shape: ModelShape, knobs: Knobs, scale: float | None = None, targets: Targets = DEFAULT_TARGETS
) -> int:
    """Predicted peak allocated bytes of training with ``knobs``; ``scale`` from :func:`calibrate`."""
    return scaled_peak(predict(shape, knobs, targets), scale)


@dataclass(frozen=True)
class Observation:
    """A peak the child reported (or the bytes an OOM needed) for the knobs it ran with."""

    knobs: Knobs
    peak_bytes: int
    exceeded: bool = False  # True: the attempt died needing *at least* this much


def calibrate(
    shape: ModelShape, observations: Sequence[Observation], targets: Targets = DEFAULT_TARGETS
) -> float | None:
    """The median over observed peaks of ``(observed - fixed) / variable``; None without data. An OOM
    (``exceeded``) is a lower bound, not a peak, and does not calibrate. Clamped to
    :data:`SCALE_RANGE`: outside it the fixed part is wrong, and a scale would only hide it."""
    measured = [o for o in observations if o.peak_bytes and not o.exceeded]  # predicted only for these
    peaks = [(o.peak_bytes, split(predict(shape, o.knobs, targets))) for o in measured]
    scales = sorted((peak - fixed) / variable for peak, (fixed, variable) in peaks if peak and variable > 0)
    if not scales:
        return None
    low, high = SCALE_RANGE
    return min(high, max(low, scales[len(scales) // 2]))


UNCALIBRATED_MARGIN = 1.25


def cannot_fit(
    shape: ModelShape, knobs: Knobs, budget: int, scale: float | None, targets: Targets = DEFAULT_TARGETS
) -> bool:
    """True when the calibrated prediction exceeds the budget, or the raw one exceeds it by 25 %."""
    margin = UNCALIBRATED_MARGIN if scale is None else 1
    return estimate_peak(shape, knobs, scale, targets) > budget * margin
