"""The configs pre-flight chooses among, enumerated from the rungs by cost class (rungs.py).

Free rungs are always taken (``expandable_segments``: +0.9 % tokens/s on the H200, noise);
throughput rungs are combined and ranked by the throughput model; quality rungs only when nothing
else fits, lightest first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from qlora_supervise.policies.rungs import QUALITY_WEIGHTS, RUNG_OF_KNOB, RUNGS, Axis, CostClass, Rung
from qlora_supervise.trainer_child.contract.spec import Knobs


@dataclass(frozen=True)
class Candidate:
    """The job's knobs with the changes ``rungs`` name."""

    knobs: Knobs
    rungs: tuple[str, ...]

    @property
    def quality_weight(self) -> float:
        return sum(QUALITY_WEIGHTS.get(name, 0.0) for name in self.rungs)


def rungs_between(old: Knobs, new: Knobs) -> tuple[str, ...]:
    """The rung names of every knob that differs, in the rungs' own order (one name per rung)."""
    before, after = dataclasses.asdict(old), dataclasses.asdict(new)
    changed = {RUNG_OF_KNOB[k] for k in before if before[k] != after[k] and k in RUNG_OF_KNOB}
    return tuple(rung.name for rung in RUNGS if rung.name in changed)


def micro_batches(knobs: Knobs) -> list[Knobs]:
    """Every micro-batch that divides the job's per-rank batch, largest first, with the
    accumulation that keeps the effective batch. Larger than the job's own too: on a 4-bit model
    most of a micro-step's cost is fixed (H200, 1B at seq 2048: micro 1 6.3k tokens/s, micro 4 25.9k)."""
    per_rank = knobs.micro_batch_size * knobs.grad_accum
    return [
        dataclasses.replace(knobs, micro_batch_size=m, grad_accum=per_rank // m)
        for m in range(per_rank, 0, -1)
        if per_rank % m == 0
    ]


def eval_batches(knobs: Knobs) -> list[Knobs]:
    """The job's eval batch and each halving (a smaller eval batch fixes an eval that does not fit)."""
    chain = [knobs]
    while chain[-1].eval_enabled and chain[-1].eval_batch_size > 1:
        chain.append(dataclasses.replace(chain[-1], eval_batch_size=chain[-1].eval_batch_size // 2))
    return chain


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
    """Every combination of ``axes``' options on ``knobs``, with the rung names taken."""
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


def quality_variants(knobs: Knobs) -> list[Candidate]:
    """The job's model at each combination of the quality halvings (seq_len, rank), lightest first."""
    axes = _searched(CostClass.QUALITY, Axis.HALVINGS)
    out = [Candidate(k, names) for k, names in _product(knobs, axes) if names]
    return sorted(out, key=lambda c: c.quality_weight)  # stable: a shorter seq before a smaller rank


#: Pre-flight cuts the job's seq_len or LoRA rank by at most this factor (two halvings). Deeper, the
#: run would train another task: a fallback model starts instead, or the run stops and names the
#: deeper cut that would fit, for the user to choose. The ladder may cut further after a real OOM.
DEEPEST_CUT_BEFORE_FALLBACK = 4


def deep_cut(job: Knobs, chosen: Knobs) -> bool:
    """Whether ``chosen`` cuts seq_len or the rank of ``job`` deeper than pre-flight may."""
    factor = DEEPEST_CUT_BEFORE_FALLBACK
    return chosen.max_seq_len * factor < job.max_seq_len or chosen.lora_r * factor < job.lora_r
