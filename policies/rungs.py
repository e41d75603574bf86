"""Rungs: pure functions ``knobs -> knobs | None`` (None: nothing left to change here).

Each rung has a stable name (job files name rungs in ladder overrides), a reason a person
can read in the log, and a tag saying what training progress survives the change.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from qlora_supervise.trainer_child.contract.attempt_facts import SampleLengths
from qlora_supervise.trainer_child.contract.spec import Knobs, rank_gpus

#: Shortest sequence length the shorten rung will go to; below this most instruction data is cut.
MIN_SEQ_LEN = 128


class Survives(str, enum.Enum):
    """What progress a restart after this rung keeps."""

    ALL = "all"  # adapter, optimizer state, step and data position
    OPTIMIZER_RESET = "optimizer_reset"  # adapter (or its SVD truncation) + step kept; optimizer fresh
    ADAPTER_REINIT = "adapter_reinit"  # adapter shape changed: training restarts from step 0


@dataclass(frozen=True)
class Rung:
    name: str
    reason: str
    survives: Survives
    apply: Callable[[Knobs], Knobs | None]


@dataclass(frozen=True)
class RungContext:
    """What a rung may need beyond the knobs: the job's fallback models, and under torchrun the
    local rank (its GPU) of the failure (None: unknown, or a single process)."""

    fallbacks: tuple[str, ...] = ()
    failed_local_rank: int | None = None


def _expandable_segments(k: Knobs) -> Knobs | None:
    return None if k.expandable_segments else dataclasses.replace(k, expandable_segments=True)


def _gradient_checkpointing(k: Knobs) -> Knobs | None:
    return None if k.gradient_checkpointing else dataclasses.replace(k, gradient_checkpointing=True)


def _halve_micro_batch(k: Knobs) -> Knobs | None:
    # The largest micro-batch of at most half that divides each rank's share of the effective
    # batch: accumulation grows to match, so micro x accumulation x ranks holds (micro 1 always divides).
    if k.micro_batch_size <= 1:
        return None
    per_rank = k.micro_batch_size * k.grad_accum
    half = next(m for m in range(k.micro_batch_size // 2, 0, -1) if per_rank % m == 0)
    return dataclasses.replace(k, micro_batch_size=half, grad_accum=per_rank // half)


def _shorten_seq_len(k: Knobs) -> Knobs | None:
    if k.max_seq_len <= MIN_SEQ_LEN:
        return None
    return dataclasses.replace(k, max_seq_len=max(MIN_SEQ_LEN, k.max_seq_len // 2))


@dataclass(frozen=True)
class TruncationCost:
    """What ``max_seq_len`` cuts of the training samples (estimates when the lengths are a sample)."""

    max_seq_len: int
    truncated: int  # samples longer than max_seq_len, scaled to all rows
    rows: int
    tokens_lost: float  # share of all tokens beyond max_seq_len
    exact: bool

    def text(self) -> str:
        about = "" if self.exact else "about "
        return (
            f"{about}{self.truncated} of {self.rows} samples truncated, "
            f"{_percent(self.tokens_lost)} of tokens lost at max_seq_len {self.max_seq_len}"
        )


def truncation_cost(lengths: SampleLengths, max_seq_len: int) -> TruncationCost:
    """How many samples ``max_seq_len`` truncates and the share of tokens it drops."""
    longer = [length for length in lengths.lengths if length > max_seq_len]
    total = sum(lengths.lengths)
    lost = sum(length - max_seq_len for length in longer) / total if total else 0.0
    scaled = round(len(longer) * lengths.rows / len(lengths.lengths))
    return TruncationCost(max_seq_len, scaled, lengths.rows, lost, lengths.exact)


def shorten_cost_text(lengths: SampleLengths, old: Knobs, new: Knobs) -> str:
    """The cost of going from ``old.max_seq_len`` to ``new.max_seq_len``, for the rung's reason."""
    before = truncation_cost(lengths, old.max_seq_len)
    after = truncation_cost(lengths, new.max_seq_len)
    return f"{after.text()} (at {old.max_seq_len}: {before.truncated}, {_percent(before.tokens_lost)})"


def _percent(share: float) -> str:
    return f"{100 * share:.1f} %"


def _paged_8bit_optimizer(k: Knobs) -> Knobs | None:
    return None if k.optimizer == "paged_adamw_8bit" else dataclasses.replace(k, optimizer="paged_adamw_8bit")


def _halve_lora_rank(k: Knobs) -> Knobs | None:
    if k.lora_r <= 4:
        return None
    # alpha scales with r so that alpha / r, the effective learning-rate scale of LoRA, is kept.
    return dataclasses.replace(k, lora_r=k.lora_r // 2, lora_alpha=max(1, k.lora_alpha // 2))


def _quantize_4bit(k: Knobs) -> Knobs | None:
    wanted = dataclasses.replace(k, load_in_4bit=True, quant_type="nf4", double_quant=True)
    return None if wanted == k else wanted


def _bf16_head(k: Knobs) -> Knobs | None:
    return None if k.bf16_head else dataclasses.replace(k, bf16_head=True)


def _activation_offload(k: Knobs) -> Knobs | None:
    return None if k.activation_offload else dataclasses.replace(k, activation_offload=True)


def _halve_eval_batch(k: Knobs) -> Knobs | None:
    if k.eval_batch_size <= 1:
        return None
    return dataclasses.replace(k, eval_batch_size=k.eval_batch_size // 2)


def _disable_eval(k: Knobs) -> Knobs | None:
    return None if not k.eval_enabled else dataclasses.replace(k, eval_enabled=False)


def _merge_on_cpu(k: Knobs) -> Knobs | None:
    return None if k.merge_on_cpu else dataclasses.replace(k, merge_on_cpu=True)


def _optimizer_state_on_host(k: Knobs) -> Knobs | None:
    # On one process transformers already reads the state with map_location="cpu": nothing to change.
    if k.optimizer_state_on_host or k.world_size <= 1:
        return None
    return dataclasses.replace(k, optimizer_state_on_host=True)


def _fresh_optimizer_state(k: Knobs) -> Knobs | None:
    return None if k.fresh_optimizer_state else dataclasses.replace(k, fresh_optimizer_state=True)


def smaller_model(context: RungContext) -> Rung:
    """The last rung: the next fallback model of the job (the adapter starts again)."""

    def apply(k: Knobs) -> Knobs | None:
        # The job's model is not in the fallbacks: from it, the first fallback is next.
        chain = context.fallbacks
        position = chain.index(k.model) + 1 if k.model in chain else 0
        if position >= len(chain):
            return None
        return dataclasses.replace(k, model=chain[position])

    return Rung("smaller_model", "fall back to a smaller model", Survives.ADAPTER_REINIT, apply)


def drop_rank(context: RungContext) -> Rung:
    """One rank fewer, without the failing rank's card, accumulation raised to keep the batch.

    micro x accumulation x ranks must come out exactly: 2 -> 1 ranks doubles accumulation, 4 -> 3
    needs it divisible by 3. Where it cannot be kept (or one rank is left), the rung does not apply.
    """

    def apply(k: Knobs) -> Knobs | None:
        ranks = k.world_size
        if ranks <= 1 or (k.grad_accum * ranks) % (ranks - 1):
            return None
        cards = rank_gpus(k)
        failed = context.failed_local_rank
        cards.pop(failed if failed is not None and 0 <= failed < len(cards) else len(cards) - 1)
        gpus = "" if cards == list(range(ranks - 1)) else ",".join(map(str, cards))
        accum = k.grad_accum * ranks // (ranks - 1)
        return dataclasses.replace(k, world_size=ranks - 1, grad_accum=accum, gpus=gpus)

    reason = (
        "one card keeps failing: restart on the remaining cards, accumulation raised to keep the "
        "effective batch (micro-batch x accumulation x ranks)"
    )
    return Rung("drop_rank", reason, Survives.ALL, apply)


_STATIC_RUNGS: tuple[Rung, ...] = (
    Rung(
        "expandable_segments",
        "reserved-but-unallocated memory could have served the request: let the allocator grow segments",
        Survives.ALL,
        _expandable_segments,
    ),
    Rung(
        "gradient_checkpointing",
        "recompute activations in backward instead of keeping them",
        Survives.ALL,
        _gradient_checkpointing,
    ),
    Rung(
        "halve_micro_batch",
        "halve the micro-batch and double accumulation: same effective batch, half the activations",
        Survives.ALL,
        _halve_micro_batch,
    ),
    Rung(
        "shorten_seq_len",
        "halve max_seq_len: activations grow with sequence length",
        Survives.ALL,
        _shorten_seq_len,
    ),
    Rung(
        "paged_8bit_optimizer",
        "8-bit paged AdamW: a quarter of the optimizer state, paged out under pressure",
        Survives.OPTIMIZER_RESET,
        _paged_8bit_optimizer,
    ),
    Rung(
        "halve_lora_rank",
        "halve the LoRA rank (alpha with it): fewer trainable parameters and optimizer state; the "
        "adapter is cut to the new rank by truncated SVD of its trained update, so progress is kept",
        Survives.OPTIMIZER_RESET,
        _halve_lora_rank,
    ),
    Rung(
        "quantize_4bit",
        "load the base model in 4-bit NF4 with double quantization",
        Survives.ALL,
        _quantize_4bit,
    ),
    Rung(
        "bf16_head",
        "keep the embeddings and LM head in bf16 instead of fp32 (norms stay fp32): half their bytes",
        Survives.ALL,
        _bf16_head,
    ),
    Rung(
        "activation_offload",
        "keep the activations saved for backward in host memory (save_on_cpu): slower, far less GPU memory",
        Survives.ALL,
        _activation_offload,
    ),
    Rung("halve_eval_batch", "halve the evaluation batch", Survives.ALL, _halve_eval_batch),
    Rung("disable_eval", "turn evaluation off", Survives.ALL, _disable_eval),
    Rung(
        "optimizer_state_on_host",
        "read the checkpoint's optimizer state into host memory and copy it to the card tensor by "
        "tensor, not onto the card whole (transformers does so under torchrun)",
        Survives.ALL,
        _optimizer_state_on_host,
    ),
    Rung(
        "fresh_optimizer_state",
        "resume the adapter and the step with a fresh optimizer state, the LR schedule kept at the "
        "step: the saved moments are not loaded",
        Survives.OPTIMIZER_RESET,
        _fresh_optimizer_state,
    ),
    Rung(
        "merge_on_cpu",
        "merge the adapter in a separate process on the CPU",
        Survives.ALL,
        _merge_on_cpu,
    ),
)

STATIC_RUNGS: Mapping[str, Rung] = {rung.name: rung for rung in _STATIC_RUNGS}

#: Every rung name a job file may use in ``supervise.ladders``.
RUNG_NAMES: frozenset[str] = frozenset({*STATIC_RUNGS, "smaller_model", "drop_rank"})

#: Rungs that were, and why a job may no longer name them (the job file's validation says it).
RETIRED_RUNGS: Mapping[str, str] = {
    "cpu_offload": (
        "cpu_offload cannot train on one GPU: accelerate refuses to train 4-bit weights offloaded to "
        "the CPU, and bitsandbytes then fails on meta tensors (Tensor.item() cannot be called on meta "
        "tensors); use activation_offload (saved activations in host memory) or bf16_head instead"
    ),
}


def rung_by_name(name: str, context: RungContext) -> Rung:
    if name == "smaller_model":
        return smaller_model(context)
    if name == "drop_rank":
        return drop_rank(context)
    return STATIC_RUNGS[name]
