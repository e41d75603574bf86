"""The configs pre-flight chooses among, enumerated from the rungs by cost class, the state of one
search (each config's predictions, cached, against the card and host budgets), what the pre-flight
returns, and what ``plan`` shows of each rung (:func:`rung_effects`)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from qlora_supervise.policies import rungs
from qlora_supervise.policies.memory.gpu import DEFAULT_TARGETS, Prediction
from qlora_supervise.policies.memory.host import host_train_need
from qlora_supervise.policies.memory.shape import ModelShape, Targets
from qlora_supervise.policies.memory_model import estimate_peak
from qlora_supervise.policies.rungs import RUNGS, Axis, CostClass, Rung, knob_changes, rungs_between
from qlora_supervise.policies.search import throughput
from qlora_supervise.policies.search.budget import HostBudget
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
    changes: dict[str, tuple[Any, Any]]
    reasons: tuple[str, ...]
    budget_bytes: int
    margin: float
    quality_changed: bool = False
    cost: float = 0.0  # predicted share of tokens/s lost against the job as written (negative: faster)
    tokens_per_s: float | None = None  # predicted (or measured) for ``knobs``
    ranking: tuple[Ranked, ...] = ()  # every fitting candidate of the chosen model, fastest first
    speed_trial: tuple[TrialCandidate, ...] = ()  # for the child to time; empty: nothing to choose
    fallback: str | None = None  # the fallback model started instead of the job's
    nothing_fits: NothingFits | None = None
    host_peak_bytes: int | None = None  # the chosen config's training host peak
    # Candidates that fit the card but not the host: how many, and the smallest host need of them.
    host_rejected: tuple[int, int | None] = (0, None)

    @property
    def fits(self) -> bool:
        """False: nothing the pre-flight may change is predicted to fit (see ``nothing_fits``)."""
        return self.nothing_fits is None

    @property
    def fits_as_written(self) -> bool:
        return self.fits and not self.changes


DEFAULT_MARGIN = 0.08


def micro_batches(knobs: Knobs) -> list[Knobs]:
    """Every micro-batch that divides the job's per-rank batch, largest first, with the
    accumulation that keeps the effective batch. Larger than the job's own too: on a 4-bit model
    most of a micro-step's cost is fixed (H200, 1B at seq 2048: micro 1 6.3k tokens/s, micro 4 25.9k)."""
    per_rank = knobs.micro_batch_size * knobs.grad_accum
    divisors = [m for m in range(per_rank, 0, -1) if per_rank % m == 0]
    return [dataclasses.replace(knobs, micro_batch_size=m, grad_accum=per_rank // m) for m in divisors]


def _options(rung: Rung, knobs: Knobs) -> list[tuple[Knobs, tuple[str, ...]]]:
    """What the search tries for ``rung`` on ``knobs``, each with the rung names it took."""
    if rung.axis is Axis.EITHER:
        values: list[dict[str, Any]] = [{rung.knob: False}, {rung.knob: True}]
        return [(dataclasses.replace(knobs, **value), ()) for value in values]
    if rung.axis is Axis.DIVISORS:
        return [(k, ()) for k in micro_batches(knobs)]
    out: list[tuple[Knobs, tuple[str, ...]]] = [(knobs, ())]
    # A knob the job already turned on stays on: the search goes towards less memory only.
    while (changed := rung.apply(out[-1][0])) is not None and (rung.axis is Axis.HALVINGS or len(out) < 2):
        out.append((changed, (*out[-1][1], rung.name)))
    return out


def _product(knobs: Knobs, axes: tuple[Rung, ...]) -> Iterator[tuple[Knobs, tuple[str, ...]]]:
    if not axes:
        yield knobs, ()
        return
    for option, named in _options(axes[0], knobs):
        for combined, names in _product(option, axes[1:]):
            yield combined, named + names


def _searched(cost: CostClass, *axes: Axis) -> tuple[Rung, ...]:
    return tuple(r for r in RUNGS if r.cost is cost and r.axis in axes)


def throughput_variants(knobs: Knobs) -> Iterator[Knobs]:
    """Every combination of the throughput rungs on ``knobs`` with every free rung taken (the eval
    batch apart: pre-flight fits it per candidate)."""
    free = knobs
    for rung in _searched(CostClass.FREE, *Axis):
        free = rung.apply(free) or free
    axes = _searched(CostClass.THROUGHPUT, Axis.TOGGLE, Axis.EITHER, Axis.DIVISORS)
    return (variant for variant, _ in _product(free, axes))


def most_frugal(knobs: Knobs) -> Knobs:
    """Every free and throughput rung taken as far as it goes (micro-batch 1, eval batch 1)."""
    for rung in (r for r in RUNGS if r.cost in (CostClass.FREE, CostClass.THROUGHPUT)):
        while (changed := rung.apply(knobs)) is not None:
            knobs = changed
    return knobs


def quality_variants(knobs: Knobs) -> list[tuple[Knobs, tuple[str, ...]]]:
    """Each combination of the quality halvings (seq_len, rank) with the rung names taken, lightest first."""
    out = [(k, names) for k, names in _product(knobs, _searched(CostClass.QUALITY, Axis.HALVINGS)) if names]
    # Stable: a shorter seq before a smaller rank.
    return sorted(out, key=lambda c: sum(rungs.RUNG_BY_NAME[name].quality_weight for name in c[1]))


#: Pre-flight cuts the job's seq_len or LoRA rank by at most this factor (two halvings). Deeper, the
#: run would train another task: a fallback model starts instead, or the run stops and names the
#: deeper cut that would fit, for the user to choose. The ladder may cut further after a real OOM.
DEEPEST_CUT_BEFORE_FALLBACK = 4


def deep_cut(job: Knobs, chosen: Knobs) -> bool:
    """Whether ``chosen`` cuts seq_len or the rank of ``job`` deeper than pre-flight may."""
    factor = DEEPEST_CUT_BEFORE_FALLBACK
    return chosen.max_seq_len * factor < job.max_seq_len or chosen.lora_r * factor < job.lora_r


@dataclass
class Search:
    """The predictions of one pre-flight, cached per knobs; remembers the smallest peak it saw."""

    shape: ModelShape
    job: Knobs
    budget_bytes: int
    margin: float
    scale: float | None
    targets: Targets
    speed: throughput.SpeedCalibration | None
    exclude: frozenset[Knobs]
    unusable: frozenset[str]
    host: HostBudget | None = None

    def __post_init__(self) -> None:
        self.limit = fit_limit(self.budget_bytes, self.margin)
        self.smallest: tuple[int, Knobs] | None = None  # of the configs pre-flight may start (no deep cut)
        self.deep_fit: Knobs | None = None  # the lightest deeper-than-allowed quality cut that fits
        self._peaks: dict[Knobs, int] = {}
        self._host_peaks: dict[Knobs, int] = {}
        self.host_rejected: dict[Knobs, int] = {}  # fit the card, not the host: their host peaks
        self.host_limit = None if self.host is None else fit_limit(self.host.budget_bytes)

    def peak(self, knobs: Knobs) -> int:
        if knobs not in self._peaks:
            peak = self._peaks[knobs] = estimate_peak(self.shape, knobs, self.scale, self.targets)
            if not deep_cut(self.job, knobs) and (self.smallest is None or peak < self.smallest[0]):
                self.smallest = (peak, knobs)
        return self._peaks[knobs]

    def host_peak(self, knobs: Knobs) -> int | None:
        """The training host peak of ``knobs`` (None: no host budget)."""
        if (host := self.host) is None:
            return None
        if knobs not in self._host_peaks:
            shard = host.largest_shard_bytes
            need = host_train_need(self.shape, knobs, host.checkpoint_bytes, self.targets, shard)
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
        """``knobs`` with the largest eval batch that fits, the job's or a halving of it (a smaller eval
        batch fixes an eval that does not fit); None when training itself does not."""
        if not self.fits(dataclasses.replace(knobs, eval_enabled=False)):
            return None
        while not self.fits(knobs):
            if not knobs.eval_enabled or knobs.eval_batch_size <= 1:
                return None
            knobs = dataclasses.replace(knobs, eval_batch_size=knobs.eval_batch_size // 2)
        return knobs

    def rank(self, base: Knobs) -> list[Ranked]:
        """Every fitting throughput variant of ``base``, fastest first."""
        out = []
        for variant in throughput_variants(base):
            if (fitted := self.with_eval_that_fits(variant)) is None or fitted in self.exclude:
                continue
            names = rungs_between(self.job, fitted)
            if set(names) & self.unusable:
                continue
            speed = throughput.rank_speed(self.shape, fitted, self.speed, self.targets)
            peak, host = self.peak(fitted), self.host_peak(fitted)
            out.append(Ranked(fitted, names, peak, speed.tokens_per_s, speed.measured, dearest(names), host))
        # Fastest first; at equal speed fewer changes, the larger eval batch, the higher peak.
        out.sort(key=lambda r: (-r.tokens_per_s, len(r.rungs), -r.knobs.eval_batch_size, -r.peak_bytes))
        return out

    def best(self, job: Knobs) -> tuple[list[Ranked], bool]:
        """The ranking of the lightest change that fits: (ranking, quality changed); empty: none."""
        if ranking := self.rank(job):
            return ranking, False
        for variant, names in quality_variants(job):
            if set(names) & self.unusable or not self.fits(most_frugal(variant)):
                continue
            ranking = self.rank(variant)
            if ranking and deep_cut(self.job, variant):
                self.deep_fit = self.deep_fit or ranking[0].knobs  # said, never started
            elif ranking:
                return ranking, True
        return [], True


def fit_limit(budget_bytes: int, margin: float = DEFAULT_MARGIN) -> int:
    """The most a config may peak at to fit ``budget_bytes`` with the margin (predicted, or measured
    by the speed trial: a measurement still meets the allocator's rounding under a cap)."""
    return int(budget_bytes / (1 + margin))


def dearest(names: Sequence[str]) -> CostClass:
    classes = [rungs.RUNG_CLASSES.get(name, CostClass.THROUGHPUT) for name in names]
    return max(classes, key=list(CostClass).index, default=CostClass.FREE)


def gib(value: float) -> str:
    return f"{value / (1 << 30):.2f} GiB"


@dataclass(frozen=True)
class RungEffect:
    """One rung applied alone to the job as written: what it predicts and what it costs."""

    name: str
    cost_class: CostClass
    cost: float  # predicted share of tokens/s lost (negative: faster)
    predicted_peak: int | None  # None: the rung changes nothing here
    changes: dict[str, tuple[Any, Any]]
    tokens_per_s: float | None = None


def rung_effects(
    shape: ModelShape,
    knobs: Knobs,
    targets: Targets = DEFAULT_TARGETS,
    scale: float | None = None,
    speed: throughput.SpeedCalibration | None = None,
) -> list[RungEffect]:
    """Each plan rung applied alone to ``knobs``: predicted peak and tokens/s after it."""
    base = throughput.rank_speed(shape, knobs, speed, targets).tokens_per_s
    effects = []
    for rung in rungs.PLAN_RUNGS:
        if (changed := rung.apply(knobs)) is None or rung.cost is None:
            effects.append(RungEffect(rung.name, rung.cost or CostClass.FREE, 0.0, None, {}))
            continue
        rate = throughput.rank_speed(shape, changed, speed, targets).tokens_per_s
        peak = estimate_peak(shape, changed, scale, targets)
        cost = round(1 - rate / base, 4) if base > 0 else 0.0
        effects.append(RungEffect(rung.name, rung.cost, cost, peak, knob_changes(knobs, changed), rate))
    return effects
