"""The pre-flight's verdict when nothing fits: the card (the smallest peak, what would help) or the
host (the smallest host need among the configs that fit the card, the host budget that would fit)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from qlora_supervise.policies.memory.gpu import predict
from qlora_supervise.policies.memory.host import host_train_need
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.policies.search.budget import card_reserve, host_for_budget
from qlora_supervise.policies.search.candidates import DEEPEST_CUT_BEFORE_FALLBACK
from qlora_supervise.policies.search.search_result import NothingFits, PreflightResult, knob_changes
from qlora_supervise.policies.search.search_result import gib as _gib
from qlora_supervise.policies.search.search_state import Search
from qlora_supervise.trainer_child.contract.spec import Knobs


def nothing_fits(
    search: Search,
    knobs: Knobs,
    budget_bytes: int,
    margin: float,
    head: list[str],
    fallbacks: Sequence[tuple[str, ModelShape | None]],
) -> PreflightResult:
    if search.host_rejected:  # configs fitted the card: host memory is what nothing fits
        return nothing_fits_host(search, knobs, budget_bytes, margin, head)
    assert search.smallest is not None  # the job as written was predicted first
    peak, smallest = search.smallest
    need = int(peak * (1 + margin))
    helps = [f"a budget of at least {_gib(need)} (a card of about {_gib(need + card_reserve())})"]
    if fallbacks:
        helps.append("a smaller model than every one in model.fallbacks (none of them fits either)")
    else:
        helps.append("a smaller model in model.fallbacks")
    if search.deep_fit is not None:
        deep = search.deep_fit
        helps.append(
            f"max_seq_len {deep.max_seq_len} and lora.r {deep.lora_r} written in the job (predicted to fit; "
            f"pre-flight cuts no deeper than 1/{DEEPEST_CUT_BEFORE_FALLBACK} by itself)"
        )
    text = " or ".join(helps)
    nothing = NothingFits(peak, smallest, budget_bytes, margin, text)
    verdict = (
        f"NOTHING FITS: the smallest config of every rung peaks at {_gib(peak)}, the budget is "
        f"{_gib(budget_bytes)} ({margin:.0%} margin); what would help: {text}"
    )
    return _refusal(search, knobs, (*head, verdict), budget_bytes, nothing)


def nothing_fits_host(
    search: Search, knobs: Knobs, budget_bytes: int, margin: float, head: list[str]
) -> PreflightResult:
    """Nothing that fits the card fits the host: the smallest host need among them, the host
    budget, and what would fit (a larger host budget, or the card-only configs it would allow)."""
    assert search.host is not None and search.host_limit is not None
    host_peak, smallest = min(((v, k) for k, v in search.host_rejected.items()), key=lambda x: x[0])
    need = int(host_peak * (1 + margin))
    host = search.host
    phase = host_train_need(
        search.shape, smallest, host.checkpoint_bytes, search.targets, host.largest_shard_bytes
    ).phase
    what = "loading the model" if phase == "load" else "training the smallest"
    if phase == "load" and not host.largest_shard_bytes:
        what += " (its shards unknown: the whole checkpoint counts as the file being read)"
    text = (
        f"a host budget of at least {_gib(need)} (resources.host_memory_limit, or plan --host-memory "
        f"for a host of {_gib(_host_size_text(need))}), or a smaller model in model.fallbacks"
    )
    nothing = NothingFits(host_peak, smallest, search.host.budget_bytes, margin, text, host=True)
    verdict = (
        f"NOTHING FITS HOST MEMORY: {len(search.host_rejected)} config(s) fit the card, but {what} "
        f"needs {_gib(host_peak)} of host RAM, the host budget is "
        f"{_gib(search.host.budget_bytes)} ({margin:.0%} margin); what would fit: {text}"
    )
    return dataclasses.replace(
        _refusal(search, knobs, (*head, verdict), budget_bytes, nothing),
        host_budget_bytes=search.host.budget_bytes,
        host_peak_bytes=host_peak,
        host_rejected=rejected(search),
    )


def _refusal(
    search: Search, knobs: Knobs, reasons: tuple[str, ...], budget_bytes: int, nothing: NothingFits
) -> PreflightResult:
    """The result when nothing fits: the smallest config ``nothing`` names, refused."""
    smallest = nothing.smallest_knobs
    return PreflightResult(
        knobs=smallest,
        predicted=predict(search.shape, smallest, search.targets),
        fits_as_written=False,
        changes=knob_changes(knobs, smallest),
        reasons=reasons,
        quality_changed=True,
        fits=False,
        budget_bytes=budget_bytes,
        margin=nothing.margin,
        cost=0.0,
        nothing_fits=nothing,
    )


def rejected(search: Search) -> tuple[int, int | None]:
    values = search.host_rejected.values()
    return len(search.host_rejected), min(values) if values else None


def _host_size_text(need: int) -> int:
    """The smallest host whose budget holds ``need``, rounded up to the 0.01 GiB the text shows, so
    that the size as printed, given to ``plan --host-memory``, is a budget of ``need`` at least."""
    step = (1 << 30) // 100
    return -(-host_for_budget(need) // step) * step
