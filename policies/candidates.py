"""The configs pre-flight chooses among, and what class of cost each change has.

A candidate is the job's knobs with some knobs changed, and the names of the rungs that change
them. Changes are classed by what they cost (ARCHITECTURE.md, "Choosing a config"):

* **free**: ``expandable_segments`` (measured +0.9 % tokens/s on the H200: noise), and the bf16
  head when :data:`BF16_HEAD_CLASS` says so;
* **throughput**: gradient checkpointing, another micro-batch with the accumulation that keeps the
  effective batch (every divisor of the job's per-rank batch, above the job's micro-batch too), the
  paged 8-bit optimizer,
  activation offload, the bf16 head (by default), a smaller eval batch. The throughput model
  (:mod:`.throughput`) ranks them, so no fixed cost per rung is needed;
* **quality**: a shorter seq_len, a smaller LoRA rank, a smaller model (the job's fallbacks).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from qlora_supervise.policies.rungs import MIN_SEQ_LEN, STATIC_RUNGS
from qlora_supervise.trainer_child.contract.spec import Knobs

PAGED_8BIT = "paged_adamw_8bit"


class CostClass(str, enum.Enum):
    FREE = "free"
    THROUGHPUT = "throughput"
    QUALITY = "quality"


#: The one setting for the bf16 embeddings and LM head, decided on the loss parity measured:
#: H200, 8B 128k, 60 steps: max |loss difference| 0.0037, no larger than two upcast runs differ from
#: each other (0.0037), 2.0 GiB less memory, tokens/s within the runs' 12 % noise (no gain: trl's
#: fused head never builds the logits); CPU tiny model in bf16, 200 steps: 25-step means within
#: 1.3 %, no bias (bench/results/throughput-h200-2026-12-01/parity.txt,
#: bench/results/bf16-head-parity-cpu-2026-12-01/). It changes the numerics a little and buys no
#: speed, so a job that fits as written keeps its fp32 head: it is a throughput rung, taken before
#: any quality cut (FREE would put it on every changed config).
BF16_HEAD_CLASS = CostClass.THROUGHPUT

#: The class of each rung pre-flight and ``plan`` know.
RUNG_CLASSES: Mapping[str, CostClass] = {
    "expandable_segments": CostClass.FREE,
    "bf16_head": BF16_HEAD_CLASS,
    "gradient_checkpointing": CostClass.THROUGHPUT,
    "halve_micro_batch": CostClass.THROUGHPUT,
    "paged_8bit_optimizer": CostClass.THROUGHPUT,
    "activation_offload": CostClass.THROUGHPUT,
    "halve_eval_batch": CostClass.THROUGHPUT,
    "shorten_seq_len": CostClass.QUALITY,
    "halve_lora_rank": CostClass.QUALITY,
    "smaller_model": CostClass.QUALITY,
}
#: How much each quality rung weighs when one must be taken: fewer quality steps first, and a
#: shorter sequence before a smaller rank (the ladders' order: the adapter keeps its capacity).
QUALITY_WEIGHTS: Mapping[str, float] = {"shorten_seq_len": 1.0, "halve_lora_rank": 1.2, "smaller_model": 5.0}
#: Which rung a changed knob stands for, in the journal's words.
RUNG_OF_KNOB: Mapping[str, str] = {
    "expandable_segments": "expandable_segments",
    "bf16_head": "bf16_head",
    "gradient_checkpointing": "gradient_checkpointing",
    "micro_batch_size": "halve_micro_batch",
    "optimizer": "paged_8bit_optimizer",
    "activation_offload": "activation_offload",
    "eval_batch_size": "halve_eval_batch",
    "max_seq_len": "shorten_seq_len",
    "lora_r": "halve_lora_rank",
    "model": "smaller_model",
    "optimizer_state_on_host": "optimizer_state_on_host",
    "fresh_optimizer_state": "fresh_optimizer_state",
}


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
    order = [*STATIC_RUNGS, "smaller_model"]
    return tuple(name for name in order if name in changed)


def micro_batches(knobs: Knobs) -> list[Knobs]:
    """Every micro-batch that divides the job's per-rank batch, largest first; accumulation
    changes to keep the effective batch.

    Larger than the job's own micro-batch too: the seeds' "micro-batch 1 + accumulation" is a
    habit, not a limit, and on a 4-bit model most of a micro-step's cost is fixed, so a larger
    micro-batch that fits is the cheapest speed there is (H200 sweep, 1B 128k at seq 2048 with
    checkpointing: micro 1 6.3k tokens/s, micro 4 25.9k). Whether it fits is the memory model's
    question, answered per candidate.
    """
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


def throughput_variants(knobs: Knobs) -> Iterator[Knobs]:
    """Every combination of the free and throughput knobs on ``knobs`` (the eval batch apart:
    pre-flight fits it per candidate), expandable segments always on."""
    free = dataclasses.replace(knobs, expandable_segments=True)
    if BF16_HEAD_CLASS is CostClass.FREE:
        free = dataclasses.replace(free, bf16_head=True)
    options = (
        (False, True),  # either way: checkpointing off at a smaller micro-batch may be the faster
        (free.optimizer, PAGED_8BIT) if free.optimizer != PAGED_8BIT else (PAGED_8BIT,),
        _either(free.activation_offload),
        _either(free.bf16_head),
    )
    for ckpt, optimizer, offload, head in itertools.product(*options):
        changed = dataclasses.replace(
            free, gradient_checkpointing=ckpt, optimizer=optimizer, activation_offload=offload, bf16_head=head
        )
        yield from micro_batches(changed)


def most_frugal(knobs: Knobs) -> Knobs:
    """Every memory-saving free and throughput knob on, micro-batch 1, eval batch 1."""
    return dataclasses.replace(
        micro_batches(knobs)[-1],
        expandable_segments=True,
        gradient_checkpointing=True,
        optimizer=PAGED_8BIT,
        activation_offload=True,
        bf16_head=True,
        eval_batch_size=1,
    )


def quality_variants(knobs: Knobs) -> list[Candidate]:
    """The job's model at each seq_len halving x each rank halving, lightest quality cut first."""
    out = []
    seq: Knobs | None = knobs
    seq_names: tuple[str, ...] = ()
    while seq is not None and seq.max_seq_len >= MIN_SEQ_LEN:
        rank: Knobs | None = seq
        rank_names = seq_names
        while rank is not None:
            if rank_names:
                out.append(Candidate(rank, rank_names))
            rank, rank_names = STATIC_RUNGS["halve_lora_rank"].apply(rank), (*rank_names, "halve_lora_rank")
        seq, seq_names = STATIC_RUNGS["shorten_seq_len"].apply(seq), (*seq_names, "shorten_seq_len")
    return sorted(out, key=lambda c: c.quality_weight)  # stable: a shorter seq before a smaller rank


def _either(value: bool) -> tuple[bool, ...]:
    # A knob the job already turned on stays on: pre-flight changes knobs towards less memory only.
    return (True,) if value else (False, True)


#: Pre-flight cuts the job's seq_len or LoRA rank by at most this factor (two halvings: 16384 -> 4096
#: still trains long context). Deeper, the run would train another task (seq 2048 -> 128 cuts every
#: long sample to a sixteenth): the job's fallback model starts instead, or the run stops before any
#: child and names the deeper cut that would fit, for the user to choose. The reactive ladder may
#: still cut further after a real OOM.
DEEPEST_CUT_BEFORE_FALLBACK = 4


def deep_cut(job: Knobs, chosen: Knobs) -> bool:
    """Whether ``chosen`` cuts seq_len or the rank of ``job`` deeper than pre-flight may."""
    factor = DEEPEST_CUT_BEFORE_FALLBACK
    return chosen.max_seq_len * factor < job.max_seq_len or chosen.lora_r * factor < job.lora_r
