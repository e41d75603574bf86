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
from typing import Any

from qlora_supervise.policies.memory.gpu import DEFAULT_TARGETS, predict
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.policies.rungs import RUNG_BY_NAME, RUNG_OF_KNOB
from qlora_supervise.policies.search import throughput
from qlora_supervise.policies.search.budget import HostBudget
from qlora_supervise.policies.search.nothing_fits import nothing_fits, rejected
from qlora_supervise.policies.search.search_result import NothingFits, PreflightResult, Ranked, knob_changes
from qlora_supervise.policies.search.search_result import gib as _gib
from qlora_supervise.policies.search.search_state import (
    DEFAULT_MARGIN,
    Search,
    fit_limit,
    scaled_peak,
)
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
    search = Search(shape, knobs, limit, scale, targets, speed, exclude, unusable, host)
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
        search = Search(shape, knobs, limit, None, targets, None, frozenset(), unusable, own)
        ranking, _ = search.best(job)
        if ranking:
            return model, shape, ranking
    return None


def _as_written(search: Search, knobs: Knobs, budget_bytes: int, margin: float) -> str:
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


def _host_reasons(search: Search, knobs: Knobs) -> list[str]:
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


def _speed(r: Ranked) -> str:
    return f"{r.tokens_per_s:.0f} tokens/s {'measured' if r.measured else 'predicted'}"
