"""Pre-flight: the config attempt 1 starts from, chosen by the memory and throughput models.

Rules (issues 8 and 19):

* a job predicted to fit (with the margin) starts as written;
* otherwise every combination of the free and *throughput* knobs (:mod:`.candidates`: expandable
  segments, gradient checkpointing, each micro-batch that divides the per-rank batch with the
  accumulation that keeps the effective batch, the paged 8-bit optimizer, activation offload,
  the bf16 head, and per candidate the largest eval batch that fits) is predicted, and **every**
  candidate that fits is ranked by predicted tokens/s (:mod:`.throughput`, measured numbers of
  this host or run where there are some); the fastest wins;
* *quality* knobs (seq_len, then LoRA rank) change only when no throughput candidate fits; the
  lightest quality cut that fits wins, with its fastest throughput knobs, and the result says so
  (``quality_changed``) so the caller can log it loudly;
* quality cuts go no deeper than two halvings of seq_len and of the rank
  (:data:`DEEPEST_CUT_BEFORE_FALLBACK`); when no config of the job's model fits within that, the
  job's fallback models are tried in order, as a loud quality change (``fallback``); when none
  fits either, :class:`NothingFits` names the smallest
  peak found, the budget and what would help, so the run can stop before any child starts.

**Two budgets** (issue 28): with a host budget (:class:`.budget.HostBudget`) a candidate must also
fit the host: its training host peak (:func:`.memory.host.host_train_need`: the load, the resident
child, offloaded activations, paged optimizer state, the data loader) under the host budget less the
same margin. A candidate that fits the card but not the host is no candidate; the result counts
them (``host_rejected``) and says why. When the load alone does not fit the host, or nothing that
fits the card fits the host, :class:`NothingFits` names host memory (``host``) and what would fit.

The margin (8 %) covers the model's error and the allocator's block rounding that a cap sees as
used memory; a calibrated scale shrinks the first, which is why the margin stays fixed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qlora_supervise.policies.memory.gpu import DEFAULT_TARGETS, Prediction, predict
from qlora_supervise.policies.memory.host import host_train_need
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.policies.rungs import RUNG_BY_NAME, RUNG_CLASSES, RUNG_OF_KNOB, CostClass
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
from qlora_supervise.policies.search.nothing_fits import nothing_fits, rejected
from qlora_supervise.policies.search.search_result import NothingFits, PreflightResult, Ranked, knob_changes
from qlora_supervise.policies.search.search_result import gib as _gib
from qlora_supervise.policies.search.trial_pick import TRIAL_SIZE, TRIAL_SLOWEST_SHARE, trial_candidates
from qlora_supervise.trainer_child.contract.spec import Knobs

__all__ = [
    "DEFAULT_MARGIN",
    "TRIAL_SIZE",
    "TRIAL_SLOWEST_SHARE",
    "NothingFits",
    "PreflightResult",
    "Ranked",
    "fit_limit",
    "knob_changes",
    "preflight",
    "scaled_peak",
]

DEFAULT_MARGIN = 0.08
_CLASS_ORDER = (CostClass.FREE, CostClass.THROUGHPUT, CostClass.QUALITY)


def scaled_peak(prediction: Prediction, scale: float | None) -> int:
    """The allocated peak with the variable part scaled by a calibration (None: as predicted)."""
    if scale is None:
        return prediction.peak_bytes
    from qlora_supervise.policies.memory_model import split

    fixed, variable = split(prediction)
    return fixed + int(variable * scale)


@dataclass
class _Search:
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
                    fitted, rungs, self.peak(fitted), speed.tokens_per_s, speed.measured, _dearest(rungs),
                    self.host_peak(fitted),
                )
            )  # fmt: skip
        # Fastest first; at equal speed fewer changes, the larger eval batch, then the config that
        # uses the card best.
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


def preflight(
    shape: ModelShape,
    knobs: Knobs,
    budget_bytes: int,
    margin: float = DEFAULT_MARGIN,
    scale: float | None = None,
    targets: tuple[str, ...] | str = DEFAULT_TARGETS,
    speed: throughput.SpeedCalibration | None = None,
    fallbacks: Sequence[tuple[str, ModelShape | None]] = (),
    exclude: frozenset[Knobs] = frozenset(),
    unusable: frozenset[str] = frozenset(),
    host: HostBudget | None = None,
) -> PreflightResult:
    """The fastest config predicted to fit ``budget_bytes / (1 + margin)``; see the module docstring.

    ``fallbacks``: the job's fallback models with their shapes (None: not modelled, skipped).
    ``exclude``: configs that already failed; ``unusable``: rungs charged with a failure;
    ``host``: the host budget every candidate must fit too (None: the card alone).
    """
    # One search in the docstring's order (as written, throughput, quality, fallbacks, nothing),
    # with the reasons written as it goes: splitting it would scatter the one story the journal tells.
    limit = fit_limit(budget_bytes, margin)
    search = _Search(shape, knobs, limit, scale, targets, speed, exclude, unusable, host)
    base_speed = throughput.rank_speed(shape, knobs, speed, targets).tokens_per_s
    if search.fits(knobs) and knobs not in exclude:
        ranking = search.rank(knobs)
        why = (
            f"predicted {_gib(search.peak(knobs))} fits {_gib(budget_bytes)} with the {margin:.0%} margin",
            *_host_reasons(search, knobs),
        )
        return PreflightResult(
            knobs=knobs,
            predicted=predict(shape, knobs, targets),
            fits_as_written=True,
            changes={},
            reasons=why,
            quality_changed=False,
            fits=True,
            budget_bytes=budget_bytes,
            margin=margin,
            cost=0.0,
            tokens_per_s=base_speed,
            ranking=tuple(ranking),
            speed_trial=trial_candidates(
                knobs, search.peak(knobs), base_speed, ranking, search.host_peak(knobs)
            ),
            host_budget_bytes=None if host is None else host.budget_bytes,
            host_peak_bytes=search.host_peak(knobs),
            host_rejected=rejected(search),
        )
    ranking, quality = search.best(knobs)
    fallback = None
    chosen_shape = shape
    if not ranking and (found := _fallback(knobs, limit, targets, fallbacks, unusable, host)) is not None:
        fallback, chosen_shape, ranking = found
    head = [_as_written(search, knobs, budget_bytes, margin)]
    if not ranking:
        return nothing_fits(search, knobs, budget_bytes, margin, head, fallbacks)
    chosen = ranking[0]
    reasons = [*head, *_change_reasons(knobs, chosen.knobs)]
    reasons.append(
        f"chosen: predicted {_gib(chosen.peak_bytes)} fits under {_gib(limit)}, "
        f"{_speed(chosen)} ({len(ranking)} fitting candidate(s) ranked by tokens/s)"
    )
    reasons += _host_reasons(search, chosen.knobs)
    if fallback is not None:
        reasons.append(f"no config of {knobs.model} fits: QUALITY CHANGE, the fallback model {fallback}")
    elif quality:
        reasons.append("no throughput-only change fits: QUALITY knobs changed (seq_len / LoRA rank)")
    cost = 1 - chosen.tokens_per_s / base_speed if base_speed > 0 and fallback is None else 0.0
    return PreflightResult(
        knobs=chosen.knobs,
        predicted=predict(chosen_shape, chosen.knobs, targets),
        fits_as_written=False,
        changes=knob_changes(knobs, chosen.knobs),
        reasons=tuple(reasons),
        quality_changed=quality or fallback is not None,
        fits=True,
        budget_bytes=budget_bytes,
        margin=margin,
        cost=round(cost, 4),
        tokens_per_s=chosen.tokens_per_s,
        ranking=tuple(ranking),
        speed_trial=trial_candidates(
            chosen.knobs, chosen.peak_bytes, chosen.tokens_per_s, ranking, chosen.host_peak_bytes
        ),
        fallback=fallback,
        host_budget_bytes=None if host is None else host.budget_bytes,
        host_peak_bytes=chosen.host_peak_bytes,
        host_rejected=rejected(search),
    )


def _fallback(
    knobs: Knobs,
    limit: float,
    targets: tuple[str, ...] | str,
    fallbacks: Sequence[tuple[str, ModelShape | None]],
    unusable: frozenset[str],
    host: HostBudget | None,
) -> tuple[str, ModelShape, list[Ranked]] | None:
    """The first fallback model with a config that fits, and its ranking (uncalibrated: this host's
    measurements are of the job's model)."""
    for model, shape in fallbacks:
        if shape is None:
            continue
        job = dataclasses.replace(knobs, model=model)
        # The fallback's checkpoint is not read here: its size is its parameters in 16 bits.
        own = (
            None
            if host is None
            else dataclasses.replace(host, checkpoint_bytes=shape.params * 2, largest_shard_bytes=None)
        )
        search = _Search(shape, knobs, limit, None, targets, None, frozenset(), unusable, own)
        ranking, _ = search.best(job)
        if ranking:
            return model, shape, ranking
    return None


def _as_written(search: _Search, knobs: Knobs, budget_bytes: int, margin: float) -> str:
    """Why the job as written does not start: the card, the host, or an earlier failure."""
    limit = search.limit
    if search.peak(knobs) > limit:
        peak = _gib(search.peak(knobs))
        return f"as written: predicted {peak} > {_gib(limit)} ({_gib(budget_bytes)} less {margin:.0%})"
    host = search.host_peak(knobs)
    if host is not None and search.host_limit is not None and host > search.host_limit:
        return (
            f"as written: host peak {_gib(host)} > {_gib(search.host_limit)} (host budget "
            f"{_gib(search.host.budget_bytes if search.host else 0)} less {margin:.0%})"
        )
    return f"as written: predicted {_gib(search.peak(knobs))} fits, but this config already failed"


def _host_reasons(search: _Search, knobs: Knobs) -> list[str]:
    """The host side of a choice: its training host peak against the host budget, and how many
    candidates the host ruled out."""
    host = search.host_peak(knobs)
    if host is None or search.host is None:
        return []
    out = [f"host: host need {_gib(host)} fits the host budget {_gib(search.host.budget_bytes)}"]
    if search.host_rejected:
        smallest = min(search.host_rejected.values())
        out.append(
            f"host: {len(search.host_rejected)} config(s) that fit the card are no candidates: their host "
            f"peak ({_gib(smallest)} or more) is over {_gib(search.host_limit or 0)}"
        )
    return out


def _change_reasons(old: Knobs, new: Knobs) -> list[str]:
    reasons = []
    for name, (before, after) in knob_changes(old, new).items():
        rung = RUNG_BY_NAME.get(RUNG_OF_KNOB.get(name, ""))
        why = f": {rung.reason}" if rung is not None and _towards_less_memory(name, before, after) else ""
        reasons.append(f"{name} {before} -> {after}{why}")
    return reasons


def _towards_less_memory(name: str, before: Any, after: Any) -> bool:
    if isinstance(before, bool):
        return bool(after) and not before
    if isinstance(before, int) and isinstance(after, int):
        return after < before
    return True


def _dearest(rungs: Sequence[str]) -> CostClass:
    classes = [RUNG_CLASSES.get(name, CostClass.THROUGHPUT) for name in rungs]
    return max(classes, key=_CLASS_ORDER.index, default=CostClass.FREE)


def _speed(r: Ranked) -> str:
    return f"{r.tokens_per_s:.0f} tokens/s {'measured' if r.measured else 'predicted'}"
