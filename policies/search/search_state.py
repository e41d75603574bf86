"""The state of one search: each config's predictions, cached, against the card and host budgets."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from qlora_supervise.policies.memory.gpu import Prediction, predict
from qlora_supervise.policies.memory.host import host_train_need
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.policies.memory_model import split
from qlora_supervise.policies.rungs import RUNG_CLASSES, CostClass
from qlora_supervise.policies.search import throughput
from qlora_supervise.policies.search.budget import HostBudget
from qlora_supervise.policies.search.candidates import (
    deep_cut,
    eval_batches,
    most_frugal,
    quality_variants,
    rungs_between,
    throughput_variants,
)
from qlora_supervise.policies.search.search_result import Ranked
from qlora_supervise.trainer_child.contract.spec import Knobs

DEFAULT_MARGIN = 0.08
_CLASS_ORDER = (CostClass.FREE, CostClass.THROUGHPUT, CostClass.QUALITY)


def scaled_peak(prediction: Prediction, scale: float | None) -> int:
    """The allocated peak with the variable part scaled by a calibration (None: as predicted)."""
    if scale is None:
        return prediction.peak_bytes
    fixed, variable = split(prediction)
    return fixed + int(variable * scale)


@dataclass
class Search:
    """The predictions of one pre-flight, cached per knobs; remembers the smallest peak it saw."""

    shape: ModelShape
    job: Knobs
    limit: float
    scale: float | None
    targets: tuple[str, ...] | str
    speed: throughput.SpeedCalibration | None
    exclude: frozenset[Knobs]
    unusable: frozenset[str]
    host: HostBudget | None = None
    smallest: tuple[int, Knobs] | None = None  # of the configs pre-flight may start (no deep cut)
    deep_fit: Knobs | None = None  # the lightest deeper-than-allowed quality cut that fits

    def __post_init__(self) -> None:
        self._peaks: dict[Knobs, int] = {}
        self._host_peaks: dict[Knobs, int] = {}
        self.host_rejected: dict[Knobs, int] = {}  # fit the card, not the host: their host peaks
        self.host_limit = None if self.host is None else fit_limit(self.host.budget_bytes)

    def peak(self, knobs: Knobs) -> int:
        if knobs not in self._peaks:
            self._peaks[knobs] = scaled_peak(predict(self.shape, knobs, self.targets), self.scale)
            allowed = not deep_cut(self.job, knobs)
            if allowed and (self.smallest is None or self._peaks[knobs] < self.smallest[0]):
                self.smallest = (self._peaks[knobs], knobs)
        return self._peaks[knobs]

    def host_peak(self, knobs: Knobs) -> int | None:
        """The training host peak of ``knobs`` (None: no host budget)."""
        if self.host is None:
            return None
        if knobs not in self._host_peaks:
            host = self.host
            need = host_train_need(
                self.shape, knobs, host.checkpoint_bytes, self.targets, host.largest_shard_bytes
            )
            self._host_peaks[knobs] = need.peak_bytes
        return self._host_peaks[knobs]

    def fits(self, knobs: Knobs) -> bool:
        if self.peak(knobs) > self.limit:
            return False
        host = self.host_peak(knobs)
        if host is not None and self.host_limit is not None and host > self.host_limit:
            self.host_rejected[knobs] = host
            return False
        return True

    def with_eval_that_fits(self, knobs: Knobs) -> Knobs | None:
        """``knobs`` with the largest eval batch that fits; None when training itself does not."""
        if not self.fits(dataclasses.replace(knobs, eval_enabled=False)):
            return None
        return next((k for k in eval_batches(knobs) if self.fits(k)), None)

    def rank(self, base: Knobs) -> list[Ranked]:
        """Every fitting throughput variant of ``base``, fastest first."""
        out = []
        for variant in throughput_variants(base):
            fitted = self.with_eval_that_fits(variant)
            if fitted is None or fitted in self.exclude:
                continue
            rungs = rungs_between(self.job, fitted)
            if set(rungs) & self.unusable:
                continue
            speed = throughput.rank_speed(self.shape, fitted, self.speed, self.targets)
            out.append(
                Ranked(
                    fitted, rungs, self.peak(fitted), speed.tokens_per_s, speed.measured, dearest(rungs),
                    self.host_peak(fitted),
                )
            )  # fmt: skip
        # Fastest first; at equal speed fewer changes, the larger eval batch, the higher peak.
        return sorted(
            out, key=lambda r: (-r.tokens_per_s, len(r.rungs), -r.knobs.eval_batch_size, -r.peak_bytes)
        )

    def best(self, job: Knobs) -> tuple[list[Ranked], bool]:
        """The ranking of the lightest change that fits: (ranking, quality changed); empty: none."""
        ranking = self.rank(job)
        if ranking:
            return ranking, False
        for variant in quality_variants(job):
            if set(variant.rungs) & self.unusable or not self.fits(most_frugal(variant.knobs)):
                continue
            ranking = self.rank(variant.knobs)
            if ranking and deep_cut(self.job, variant.knobs):
                self.deep_fit = self.deep_fit or ranking[0].knobs  # said, never started
            elif ranking:
                return ranking, True
        return [], True


def fit_limit(budget_bytes: int, margin: float = DEFAULT_MARGIN) -> int:
    """The most a config may peak at to fit ``budget_bytes`` with the margin (predicted, or measured
    by the speed trial: a measurement still meets the allocator's rounding under a cap)."""
    return int(budget_bytes / (1 + margin))


def dearest(rungs: Sequence[str]) -> CostClass:
    classes = [RUNG_CLASSES.get(name, CostClass.THROUGHPUT) for name in rungs]
    return max(classes, key=_CLASS_ORDER.index, default=CostClass.FREE)
