"""Pre-flight: the config attempt 1 starts from, chosen by the memory and throughput models. The job as
written when it is predicted to fit with the margin (8 %: the model's error and the allocator's rounding under
a cap); else the fastest fitting combination of the free and throughput knobs (:mod:`.search_state`); else the
lightest quality cut, no deeper than :data:`.search_state.DEEPEST_CUT_BEFORE_FALLBACK` (``quality_changed``);
else a fallback model (``fallback``); else :class:`NothingFits`. With a host budget a candidate must fit the
host too; those it rules out are counted (``host_rejected``). docs/planning.md tells the rules."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from qlora_supervise.policies.memory.gpu import DEFAULT_TARGETS, predict
from qlora_supervise.policies.memory.host import host_train_need
from qlora_supervise.policies.memory.shape import ModelShape, Targets
from qlora_supervise.policies.rungs import RUNG_BY_NAME, RUNG_OF_KNOB, CostClass, knob_changes
from qlora_supervise.policies.search import search_state, throughput
from qlora_supervise.policies.search.budget import HostBudget, card_reserve, host_for_budget
from qlora_supervise.policies.search.search_state import PreflightResult, Ranked, Search
from qlora_supervise.policies.search.search_state import gib as _gib
from qlora_supervise.trainer_child.contract.spec import Knobs, TrialCandidate

TRIAL_SIZE = 3  # The speed trial times at most this many candidates, the chosen one first.
#: The speed trial skips a candidate predicted at less than this share of the chosen config's
#: tokens/s: it cannot win, and the slow one eats the trial (H200: 45 s of a 54 s trial).
TRIAL_SLOWEST_SHARE = 0.5


def preflight(
    shape: ModelShape,
    knobs: Knobs,
    budget_bytes: int,
    margin: float = search_state.DEFAULT_MARGIN,
    scale: float | None = None,
    targets: Targets = DEFAULT_TARGETS,
    speed: throughput.SpeedCalibration | None = None,
    fallbacks: Sequence[tuple[str, ModelShape | None]] = (),
    exclude: frozenset[Knobs] = frozenset(),
    unusable: frozenset[str] = frozenset(),
    host: HostBudget | None = None,
) -> PreflightResult:
    """The fastest config predicted to fit ``budget_bytes / (1 + margin)``; ``fallbacks``: the job's
    fallback models with their shapes (None: not modelled); ``exclude``: configs that already
    failed; ``unusable``: rungs charged with a failure; ``host``: the host budget (None: none)."""
    search = Search(shape, knobs, budget_bytes, margin, scale, targets, speed, exclude, unusable, host)
    base_speed = throughput.rank_speed(shape, knobs, speed, targets).tokens_per_s
    if search.fits(knobs) and knobs not in exclude:
        peak = search.peak(knobs)
        written = Ranked(knobs, (), peak, base_speed, False, CostClass.FREE, search.host_peak(knobs))
        ranking = search.rank(knobs)  # first: ranking counts the configs the host rules out
        why = [f"predicted {_gib(peak)} fits {_gib(budget_bytes)} with the {margin:.0%} margin"]
        why += _host_reasons(search, knobs)
        return _result(search, shape, written, ranking, why)
    ranking, quality = search.best(knobs)
    fallback, chosen_shape = None, shape
    if not ranking and (found := _fallback(search, fallbacks)) is not None:
        fallback, chosen_shape, ranking = found
    head = [_as_written(search, knobs)]
    if not ranking:
        return _nothing_fits(search, head, bool(fallbacks))
    chosen = ranking[0]
    reasons = [*head, *_change_reasons(knobs, chosen.knobs)]
    reasons.append(
        f"chosen: predicted {_gib(chosen.peak_bytes)} fits under {_gib(search.limit)}, "
        f"{chosen.tokens_per_s:.0f} tokens/s {'measured' if chosen.measured else 'predicted'} "
        f"({len(ranking)} fitting candidate(s) ranked by tokens/s)"
    )
    reasons += _host_reasons(search, chosen.knobs)
    if fallback is not None:
        reasons.append(f"no config of {knobs.model} fits: QUALITY CHANGE, the fallback model {fallback}")
    elif quality:
        reasons.append("no throughput-only change fits: QUALITY knobs changed (seq_len / LoRA rank)")
    cost = 1 - chosen.tokens_per_s / base_speed if base_speed > 0 and fallback is None else 0.0
    return dataclasses.replace(
        _result(search, chosen_shape, chosen, ranking, reasons),
        quality_changed=quality or fallback is not None,
        cost=round(cost, 4),
        fallback=fallback,
    )


def _result(
    search: Search, shape: ModelShape, chosen: Ranked, ranking: list[Ranked], reasons: list[str]
) -> PreflightResult:
    """A fitting choice: ``chosen`` (the job as written when it changes nothing) and its ranking."""
    return PreflightResult(
        knobs=chosen.knobs,
        predicted=predict(shape, chosen.knobs, search.targets),
        changes=knob_changes(search.job, chosen.knobs),
        reasons=tuple(reasons),
        budget_bytes=search.budget_bytes,
        margin=search.margin,
        tokens_per_s=chosen.tokens_per_s,
        ranking=tuple(ranking),
        speed_trial=trial_candidates(chosen, ranking),
        host_peak_bytes=chosen.host_peak_bytes,
        host_rejected=_rejected(search),
    )


def _fallback(
    search: Search, fallbacks: Sequence[tuple[str, ModelShape | None]]
) -> tuple[str, ModelShape, list[Ranked]] | None:
    """The first fallback model with a config that fits the job's ``search``, and its ranking
    (uncalibrated: this host's measurements are of the job's model)."""
    knobs, host = search.job, search.host
    fresh = dataclasses.replace(search, scale=None, speed=None, exclude=frozenset())
    for model, shape in fallbacks:
        if shape is None:
            continue
        # The fallback's checkpoint is not read here: its size is its parameters in 16 bits.
        own = host and dataclasses.replace(host, checkpoint_bytes=shape.params * 2, largest_shard_bytes=None)
        fallback = dataclasses.replace(fresh, shape=shape, host=own)
        ranking, _ = fallback.best(dataclasses.replace(knobs, model=model))
        if ranking:
            return model, shape, ranking
    return None


def _as_written(search: Search, knobs: Knobs) -> str:
    """Why the job as written does not start: the card, the host, or an earlier failure."""
    peak, limit, margin = search.peak(knobs), search.limit, search.margin
    if peak > limit:
        budget = _gib(search.budget_bytes)
        return f"as written: predicted {_gib(peak)} > {_gib(limit)} ({budget} less {margin:.0%})"
    host = search.host_peak(knobs)
    if host is not None and search.host_limit is not None and host > search.host_limit:
        return (
            f"as written: host peak {_gib(host)} > {_gib(search.host_limit)} (host budget "
            f"{_gib(search.host.budget_bytes if search.host else 0)} less {margin:.0%})"
        )
    return f"as written: predicted {_gib(peak)} fits, but this config already failed"


def _host_reasons(search: Search, knobs: Knobs) -> list[str]:
    """The host side of a choice: its need against the host budget, and the candidates the host ruled out."""
    if (host := search.host_peak(knobs)) is None or search.host is None:
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
    """Each changed knob, with its rung's reason where it moved towards less memory."""
    reasons = []
    for name, (before, after) in knob_changes(old, new).items():
        rung = RUNG_BY_NAME.get(RUNG_OF_KNOB.get(name, ""))
        if isinstance(before, bool):
            less = bool(after) and not before
        else:
            less = after < before if isinstance(before, int) and isinstance(after, int) else True
        why = f": {rung.reason}" if rung is not None and less else ""
        reasons.append(f"{name} {before} -> {after}{why}")
    return reasons


def _nothing_fits(search: Search, head: list[str], fallbacks: bool) -> PreflightResult:
    """The refusal when nothing fits the card: the smallest peak and what would help (``fallbacks``:
    the job has fallback models, none of which fits)."""
    if search.host_rejected:  # configs fitted the card: host memory is what nothing fits
        return _nothing_fits_host(search, head)
    assert search.smallest is not None  # the job as written was predicted first
    peak, smallest = search.smallest
    budget_bytes, margin = search.budget_bytes, search.margin
    need = int(peak * (1 + margin))
    helps = [f"a budget of at least {_gib(need)} (a card of about {_gib(need + card_reserve())})"]
    if fallbacks:
        helps.append("a smaller model than every one in model.fallbacks (none of them fits either)")
    else:
        helps.append("a smaller model in model.fallbacks")
    if (deep := search.deep_fit) is not None:
        helps.append(
            f"max_seq_len {deep.max_seq_len} and lora.r {deep.lora_r} written in the job (predicted to fit; "
            f"pre-flight cuts no deeper than 1/{search_state.DEEPEST_CUT_BEFORE_FALLBACK} by itself)"
        )
    text = " or ".join(helps)
    nothing = search_state.NothingFits(peak, smallest, budget_bytes, margin, text)
    verdict = (
        f"NOTHING FITS: the smallest config of every rung peaks at {_gib(peak)}, the budget is "
        f"{_gib(budget_bytes)} ({margin:.0%} margin); what would help: {text}"
    )
    return _refusal(search, (*head, verdict), nothing)


def _nothing_fits_host(search: Search, head: list[str]) -> PreflightResult:
    """Nothing that fits the card fits the host: their smallest host need, and the budget that would fit."""
    assert search.host is not None and search.host_limit is not None
    host_peak, smallest = min(((v, k) for k, v in search.host_rejected.items()), key=lambda x: x[0])
    host, margin = search.host, search.margin
    need = int(host_peak * (1 + margin))
    shard = host.largest_shard_bytes
    phase = host_train_need(search.shape, smallest, host.checkpoint_bytes, search.targets, shard).phase
    what = "loading the model" if phase == "load" else "training the smallest"
    if phase == "load" and not shard:
        what += " (its shards unknown: the whole checkpoint counts as the file being read)"
    # The smallest host whose budget holds ``need``, rounded up to the 0.01 GiB the text shows, so
    # that the size as printed, given to ``plan --host-memory``, is a budget of ``need`` at least.
    step = (1 << 30) // 100
    size = -(-host_for_budget(need) // step) * step
    text = (
        f"a host budget of at least {_gib(need)} (resources.host_memory_limit, or plan --host-memory "
        f"for a host of {_gib(size)}), or a smaller model in model.fallbacks"
    )
    nothing = search_state.NothingFits(host_peak, smallest, host.budget_bytes, margin, text, host=True)
    verdict = (
        f"NOTHING FITS HOST MEMORY: {len(search.host_rejected)} config(s) fit the card, but {what} "
        f"needs {_gib(host_peak)} of host RAM, the host budget is "
        f"{_gib(host.budget_bytes)} ({margin:.0%} margin); what would fit: {text}"
    )
    return dataclasses.replace(
        _refusal(search, (*head, verdict), nothing),
        host_peak_bytes=host_peak,
        host_rejected=_rejected(search),
    )


def _refusal(search: Search, reasons: tuple[str, ...], nothing: search_state.NothingFits) -> PreflightResult:
    smallest = nothing.smallest_knobs
    return PreflightResult(
        knobs=smallest,
        predicted=predict(search.shape, smallest, search.targets),
        changes=knob_changes(search.job, smallest),
        reasons=reasons,
        budget_bytes=search.budget_bytes,
        margin=nothing.margin,
        quality_changed=True,
        nothing_fits=nothing,
    )


def _rejected(search: Search) -> tuple[int, int | None]:
    return len(search.host_rejected), min(search.host_rejected.values(), default=None)


def trial_candidates(chosen: Ranked, ranking: Sequence[Ranked]) -> tuple[TrialCandidate, ...]:
    """The speed trial's candidates: the chosen config and the fastest others that differ from it
    only in what changes without a reload (micro-batch, accumulation, checkpointing), none slower
    than :data:`TRIAL_SLOWEST_SHARE` of it; empty when there is no other."""

    def reloadless(k: Knobs) -> Knobs:
        # The allocator setting is no training knob: candidates differ from the job's in it alone.
        return dataclasses.replace(
            k, micro_batch_size=1, grad_accum=1, gradient_checkpointing=False, expandable_segments=True
        )

    def timed(k: Knobs) -> tuple[int, int, bool]:
        return k.micro_batch_size, k.grad_accum, k.gradient_checkpointing

    knobs = chosen.knobs
    seen = {timed(knobs)}
    others = []
    for r in ranking:
        fast = r.tokens_per_s >= chosen.tokens_per_s * TRIAL_SLOWEST_SHARE
        if fast and reloadless(r.knobs) == reloadless(knobs) and timed(r.knobs) not in seen:
            seen.add(timed(r.knobs))
            others.append(r)
    if not others or knobs.world_size > 1:  # one process only: ranks would have to agree
        return ()
    return tuple(
        TrialCandidate(*timed(r.knobs), round(r.tokens_per_s, 1), r.peak_bytes, r.host_peak_bytes)
        for r in (chosen, *others[: TRIAL_SIZE - 1])
    )
