"""Pre-flight: the config attempt 1 starts from, chosen by the memory model before anything runs.

Rules (issue 8):

* a job predicted to fit (with the margin) starts as written;
* otherwise only *throughput* knobs change first: expandable_segments, gradient checkpointing,
  a smaller micro-batch with more accumulation (the effective batch is kept), the paged 8-bit
  optimizer. Every combination is tried and the cheapest one predicted to fit wins; rungs are
  combined when one alone does not fit;
* *quality* knobs (seq_len, then LoRA rank) change only when no throughput combination fits,
  and the result says so (``quality_changed``) so the caller can log it loudly.

Costs are the share of tokens/s a rung costs (:data:`RUNG_COSTS`), measured on the H200 with
``bench/memory_grid.py --set rungs`` (bench/results/memory-grid-h200-2026-12-01/rungs-table.txt:
the 7B, seq 2048, r16 on q/k/v/o, effective batch 8, alone on the card, each rung alone against
one baseline). Recomputation costs 26 %, half the micro-batch with twice the accumulation 6 %,
the paged 8-bit optimizer 0.5 %; expandable_segments measured 0.9 % *faster* (noise: it is free)
and reserved 0.7 GiB less. Checkpointing with half the micro-batch measured 31.9 %, next to the
32.3 % the summed costs give, so summing the costs of combined rungs is kept. CPU offload was not
measured; its cost is a prior (it moves the optimizer step over PCIe).

The margin (8 %) covers the model's error (target: median 5 %, worst 15 % on the grid) and
the allocator's block rounding that a cap sees as used memory; a calibrated scale shrinks the
first, which is why the margin stays fixed rather than growing with uncertainty.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from qlora_supervise.policies.memory.gpu import DEFAULT_TARGETS, Prediction, predict
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.policies.rungs import MIN_SEQ_LEN, STATIC_RUNGS
from qlora_supervise.trainer_child.contract.spec import Knobs

DEFAULT_MARGIN = 0.08
PAGED_8BIT = "paged_adamw_8bit"


class CostClass(str, enum.Enum):
    FREE = "free"
    THROUGHPUT = "throughput"
    QUALITY = "quality"


#: Tokens/s of the rung-cost set (bench/results/memory-grid-h200-2026-12-01/rungs-table.txt):
#: the baseline (micro-batch 4 x 2, no checkpointing, adamw_torch) and each rung alone on it.
RUNG_TOKENS_PER_S: Mapping[str, float] = {
    "baseline": 10470.7,
    "gradient_checkpointing": 7743.2,
    "halve_micro_batch": 9811.8,
    "paged_8bit_optimizer": 10416.0,
    "expandable_segments": 10565.0,
}
#: Not in the rung-cost set: a prior (see the module docstring).
CPU_OFFLOAD_COST = 0.6


def measured_cost(rung: str) -> float:
    """The share of the baseline's tokens/s ``rung`` loses on the H200; never below 0 (faster is free)."""
    return max(0.0, round(1.0 - RUNG_TOKENS_PER_S[rung] / RUNG_TOKENS_PER_S["baseline"], 4))


#: Fraction of tokens/s each rung costs (measured; quality rungs cost quality, not throughput).
RUNG_COSTS: Mapping[str, float] = {
    "expandable_segments": measured_cost("expandable_segments"),
    "paged_8bit_optimizer": measured_cost("paged_8bit_optimizer"),
    "halve_micro_batch": measured_cost("halve_micro_batch"),
    "gradient_checkpointing": measured_cost("gradient_checkpointing"),
    "cpu_offload": CPU_OFFLOAD_COST,
    "shorten_seq_len": 0.0,
    "halve_lora_rank": 0.0,
    "smaller_model": 0.0,
}
#: How much each quality rung weighs when one must be taken: fewer quality steps first, and a
#: shorter sequence before a smaller rank (the ladders' order: the adapter keeps its capacity).
QUALITY_WEIGHTS: Mapping[str, float] = {"shorten_seq_len": 1.0, "halve_lora_rank": 1.2, "smaller_model": 5.0}
RUNG_CLASSES: Mapping[str, CostClass] = {
    "expandable_segments": CostClass.FREE,
    "gradient_checkpointing": CostClass.THROUGHPUT,
    "halve_micro_batch": CostClass.THROUGHPUT,
    "paged_8bit_optimizer": CostClass.THROUGHPUT,
    "cpu_offload": CostClass.THROUGHPUT,
    "shorten_seq_len": CostClass.QUALITY,
    "halve_lora_rank": CostClass.QUALITY,
    "smaller_model": CostClass.QUALITY,
}
#: The rungs the plan shows, in ladder order.
PLAN_RUNGS = (
    "expandable_segments",
    "gradient_checkpointing",
    "halve_micro_batch",
    "paged_8bit_optimizer",
    "shorten_seq_len",
    "halve_lora_rank",
)


@dataclass(frozen=True)
class RungEffect:
    """One rung applied alone to the job as written: what it predicts and what it costs."""

    name: str
    cost_class: CostClass
    cost: float
    predicted_peak: int | None  # None: the rung changes nothing here
    changes: Mapping[str, tuple[Any, Any]]


@dataclass(frozen=True)
class PreflightResult:
    """The knobs attempt 1 should run with, and why."""

    knobs: Knobs
    predicted: Prediction
    fits_as_written: bool
    changes: Mapping[str, tuple[Any, Any]]
    reasons: tuple[str, ...]
    quality_changed: bool
    fits: bool  # False: nothing the pre-flight may change is predicted to fit
    budget_bytes: int
    margin: float
    cost: float  # the summed throughput cost of the changes (RUNG_COSTS)


def scaled_peak(prediction: Prediction, scale: float | None) -> int:
    """The allocated peak with the variable part scaled by a calibration (None: as predicted)."""
    if scale is None:
        return prediction.peak_bytes
    from qlora_supervise.policies.memory_model import split

    fixed, variable = split(prediction)
    return fixed + int(variable * scale)


def preflight(
    shape: ModelShape,
    knobs: Knobs,
    budget_bytes: int,
    margin: float = DEFAULT_MARGIN,
    scale: float | None = None,
    targets: tuple[str, ...] | str = DEFAULT_TARGETS,
) -> PreflightResult:
    """The cheapest config predicted to fit ``budget_bytes / (1 + margin)``; see the module docstring."""
    # One search in the docstring's order (as written, throughput, quality), with the reasons
    # written as it goes: splitting it would scatter the one story the journal tells.
    limit = budget_bytes / (1 + margin)

    def peak(k: Knobs) -> int:
        return scaled_peak(predict(shape, k, targets), scale)

    as_written = predict(shape, knobs, targets)
    if peak(knobs) <= limit:
        why = (f"predicted {_gib(peak(knobs))} fits {_gib(budget_bytes)} with the {margin:.0%} margin",)
        return PreflightResult(knobs, as_written, True, {}, why, False, True, budget_bytes, margin, 0.0)
    best = _cheapest_fitting(_throughput_candidates(knobs), peak, limit)
    quality = False
    if best is None:
        quality = True
        best = _cheapest_fitting(_quality_candidates(knobs), peak, limit)
    fits = best is not None
    if best is None:
        best = min(_quality_candidates(knobs), key=lambda c: peak(c[0]))  # the smallest there is
    chosen, applied = best
    changes = _changes(knobs, chosen)
    reasons = [
        f"as written: predicted {_gib(peak(knobs))} > {_gib(limit)} ({_gib(budget_bytes)} less {margin:.0%})"
    ]
    reasons += [f"{name}: {STATIC_RUNGS[name].reason}" for name in dict.fromkeys(applied)]
    verdict = "fits" if fits else "still does NOT fit"
    reasons.append(f"chosen: predicted {_gib(peak(chosen))} {verdict} under {_gib(limit)}")
    if quality:
        reasons.append("no throughput-only change fits: QUALITY knobs changed (seq_len / LoRA rank)")
    cost = sum(RUNG_COSTS[name] for name in applied)
    return PreflightResult(
        chosen, predict(shape, chosen, targets), False, changes, tuple(reasons), quality, fits,
        budget_bytes, margin, cost,
    )  # fmt: skip


Candidate = tuple[Knobs, tuple[str, ...]]


def _cheapest_fitting(candidates: Iterator[Candidate], peak: Any, limit: float) -> Candidate | None:
    """The fitting candidate of least cost; ties go to the larger micro-batch, then the larger peak
    (the config that uses the card best)."""
    fitting = [(k, names) for k, names in candidates if peak(k) <= limit]
    if not fitting:
        return None
    return min(
        fitting,
        key=lambda c: (
            sum(QUALITY_WEIGHTS.get(n, 0.0) for n in c[1]),
            sum(RUNG_COSTS[n] for n in c[1]),
            -c[0].micro_batch_size,
            -peak(c[0]),
        ),
    )


def _micro_batches(knobs: Knobs) -> list[tuple[Knobs, tuple[str, ...]]]:
    """The job's micro-batch and each halving (accumulation grows: the effective batch is kept)."""
    chain: list[tuple[Knobs, tuple[str, ...]]] = [(knobs, ())]
    while True:
        k, names = chain[-1]
        smaller = STATIC_RUNGS["halve_micro_batch"].apply(k)
        if smaller is None:
            return chain
        chain.append((smaller, (*names, "halve_micro_batch")))


def _throughput_candidates(knobs: Knobs) -> Iterator[Candidate]:
    """Every combination of checkpointing x micro-batch halvings x paged 8-bit optimizer, with
    expandable segments on (free, and it lowers the reserve a card must hold)."""
    for gc, paged in itertools.product((False, True), (False, True)):
        k, names = knobs, ["expandable_segments"] if not knobs.expandable_segments else []
        k = dataclasses.replace(k, expandable_segments=True)
        if gc and not k.gradient_checkpointing:
            k, names = dataclasses.replace(k, gradient_checkpointing=True), [*names, "gradient_checkpointing"]
        if paged and k.optimizer != PAGED_8BIT:
            k, names = dataclasses.replace(k, optimizer=PAGED_8BIT), [*names, "paged_8bit_optimizer"]
        for smaller, halvings in _micro_batches(k):
            yield smaller, (*names, *halvings)


def _quality_candidates(knobs: Knobs) -> Iterator[Candidate]:
    """All throughput rungs taken, then seq_len halvings, then rank halvings on the shortest."""
    base = dataclasses.replace(
        knobs, expandable_segments=True, gradient_checkpointing=True, optimizer=PAGED_8BIT
    )
    for k, halvings in _micro_batches(base):
        names = _applied(knobs, base) + halvings
        seq: Knobs | None = k
        seq_names: tuple[str, ...] = names
        while seq is not None and seq.max_seq_len >= MIN_SEQ_LEN:
            rank: Knobs | None = seq
            rank_names = seq_names
            while rank is not None:
                yield rank, rank_names
                rank, rank_names = (
                    STATIC_RUNGS["halve_lora_rank"].apply(rank),
                    (*rank_names, "halve_lora_rank"),
                )
            seq, seq_names = STATIC_RUNGS["shorten_seq_len"].apply(seq), (*seq_names, "shorten_seq_len")


def _applied(old: Knobs, new: Knobs) -> tuple[str, ...]:
    names = []
    if new.expandable_segments and not old.expandable_segments:
        names.append("expandable_segments")
    if new.gradient_checkpointing and not old.gradient_checkpointing:
        names.append("gradient_checkpointing")
    if new.optimizer != old.optimizer:
        names.append("paged_8bit_optimizer")
    return tuple(names)


def rung_effects(
    shape: ModelShape,
    knobs: Knobs,
    targets: tuple[str, ...] | str = DEFAULT_TARGETS,
    scale: float | None = None,
) -> list[RungEffect]:
    """Each plan rung applied alone to ``knobs``: predicted peak after it, and its cost."""
    effects = []
    for name in PLAN_RUNGS:
        changed = STATIC_RUNGS[name].apply(knobs)
        peak = None if changed is None else scaled_peak(predict(shape, changed, targets), scale)
        changes = {} if changed is None else _changes(knobs, changed)
        effects.append(RungEffect(name, RUNG_CLASSES[name], RUNG_COSTS[name], peak, changes))
    return effects


def _changes(old: Knobs, new: Knobs) -> dict[str, tuple[Any, Any]]:
    before, after = dataclasses.asdict(old), dataclasses.asdict(new)
    return {name: (before[name], after[name]) for name in before if before[name] != after[name]}


def _gib(value: float) -> str:
    return f"{value / (1 << 30):.2f} GiB"
