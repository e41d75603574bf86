"""Rungs: the one record of each change the supervisor may make, every table derived from it, and the
ladders (:data:`DEFAULT_LADDERS`), orderings of rung names by failure kind.
A rung is a pure function ``knobs -> knobs | None`` (None: nothing left to change here) with a
stable name (job files name rungs in ladder overrides) and a reason a person can read in the log."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from qlora_supervise.trainer_child.contract.attempt_facts import SampleLengths
from qlora_supervise.trainer_child.contract.codes import OOM_KIND_BY_STAGE, FailureKind, Stage
from qlora_supervise.trainer_child.contract.spec import Knobs, rank_gpus

#: Shortest sequence length the shorten rung will go to; below this most instruction data is cut.
MIN_SEQ_LEN = 128
PAGED_8BIT = "paged_adamw_8bit"


class Survives(str, enum.Enum):
    """What progress a restart after this rung keeps."""

    ALL = "all"  # adapter, optimizer state, step and data position
    OPTIMIZER_RESET = "optimizer_reset"  # adapter (or its SVD truncation) + step kept; optimizer fresh
    ADAPTER_REINIT = "adapter_reinit"  # adapter shape changed: training restarts from step 0


class CostClass(str, enum.Enum):
    """What a change costs: free changes are always on in the search, throughput ones are ranked by
    the throughput model, quality ones only when nothing else fits."""

    FREE = "free"
    THROUGHPUT = "throughput"
    QUALITY = "quality"


class Axis(str, enum.Enum):
    """How the pre-flight search enumerates a rung's knob."""

    TOGGLE = "toggle"  # the job's value, or the rung applied once (never back: towards less memory only)
    EITHER = "either"  # off and on, whatever the job says (checkpointing off may be the faster)
    DIVISORS = "divisors"  # every value that keeps the effective batch (search_state.micro_batches)
    FITTED = "fitted"  # the largest that fits, per candidate (the eval batch)
    HALVINGS = "halvings"  # a quality cut: the rung applied 0, 1, 2... times
    NONE = "none"  # not searched: the ladder (or the fallbacks) only


@dataclass(frozen=True)
class RungContext:
    """What a rung may need beyond the knobs: the job's fallback models, and under torchrun the
    local rank of the failure (None: unknown, or a single process)."""

    fallbacks: tuple[str, ...] = ()
    failed_local_rank: int | None = None


@dataclass(frozen=True)
class Rung:
    name: str
    reason: str
    survives: Survives
    step: Callable[[Knobs, RungContext], Knobs | None]
    knob: str  # the field of Knobs it moves (the journal names the rung by it)
    cost: CostClass | None = None  # None: a ladder rung the search never takes
    axis: Axis = Axis.NONE
    quality_weight: float = 0.0  # fewer quality steps first, a shorter sequence before a smaller rank
    in_plan: bool = False  # shown by ``plan``, applied alone to the job as written
    tool_can_take: bool = False  # a foreign tool's config can express the knob (supervisor/trainers)
    # A later failure is charged to it (decide.py, rule 0); False for the rungs that answer one
    # phase's failure (load, eval, merge, a rank), which a failure of another kind must not revert.
    charged: bool = True
    context: RungContext = RungContext()

    def apply(self, knobs: Knobs) -> Knobs | None:
        return self.step(knobs, self.context)


def _set(**values: Any) -> Callable[[Knobs, RungContext], Knobs | None]:
    def step(k: Knobs, _: RungContext) -> Knobs | None:
        changed = dataclasses.replace(k, **values)
        return None if changed == k else changed

    return step


def _halve(knob: str, floor: int) -> Callable[[Knobs, RungContext], Knobs | None]:
    def step(k: Knobs, _: RungContext) -> Knobs | None:
        value = getattr(k, knob)
        return None if value <= floor else dataclasses.replace(k, **{knob: max(floor, value // 2)})

    return step


def _halve_micro_batch(k: Knobs, _: RungContext) -> Knobs | None:
    # The largest micro-batch of at most half that divides the per-rank batch; accumulation grows.
    if k.micro_batch_size <= 1:
        return None
    per_rank = k.micro_batch_size * k.grad_accum
    half = next(m for m in range(k.micro_batch_size // 2, 0, -1) if per_rank % m == 0)
    return dataclasses.replace(k, micro_batch_size=half, grad_accum=per_rank // half)


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
        lost = f"{_percent(self.tokens_lost)} of tokens lost at max_seq_len {self.max_seq_len}"
        return f"{about}{self.truncated} of {self.rows} samples truncated, {lost}"


def truncation_cost(lengths: SampleLengths, max_seq_len: int) -> TruncationCost:
    """How many samples ``max_seq_len`` truncates and the share of tokens it drops."""
    longer = [length for length in lengths.lengths if length > max_seq_len]
    total = sum(lengths.lengths)
    lost = sum(length - max_seq_len for length in longer) / total if total else 0.0
    scaled = round(len(longer) * lengths.rows / len(lengths.lengths))
    return TruncationCost(max_seq_len, scaled, lengths.rows, lost, lengths.exact)


def shorten_cost_text(lengths: SampleLengths, old: Knobs, new: Knobs) -> str:
    """The cost of going from ``old.max_seq_len`` to ``new.max_seq_len``, for the rung's reason."""
    before, after = truncation_cost(lengths, old.max_seq_len), truncation_cost(lengths, new.max_seq_len)
    return f"{after.text()} (at {old.max_seq_len}: {before.truncated}, {_percent(before.tokens_lost)})"


def _percent(share: float) -> str:
    return f"{100 * share:.1f} %"


def _halve_lora_rank(k: Knobs, _: RungContext) -> Knobs | None:
    if k.lora_r <= 4:
        return None
    # alpha scales with r so that alpha / r, the effective learning-rate scale of LoRA, is kept.
    return dataclasses.replace(k, lora_r=k.lora_r // 2, lora_alpha=max(1, k.lora_alpha // 2))


def _optimizer_state_on_host(k: Knobs, _: RungContext) -> Knobs | None:
    # On one process transformers already reads the state with map_location="cpu": nothing to change.
    if k.optimizer_state_on_host or k.world_size <= 1:
        return None
    return dataclasses.replace(k, optimizer_state_on_host=True)


def _smaller_model(k: Knobs, context: RungContext) -> Knobs | None:
    # The job's model is not in the fallbacks: from it, the first fallback is next.
    chain = context.fallbacks
    position = chain.index(k.model) + 1 if k.model in chain else 0
    return None if position >= len(chain) else dataclasses.replace(k, model=chain[position])


def _drop_rank(k: Knobs, context: RungContext) -> Knobs | None:
    # micro x accumulation x ranks must come out exactly (4 -> 3 ranks needs accumulation x 4 / 3).
    ranks, left = k.world_size, k.world_size - 1
    if ranks <= 1 or (k.grad_accum * ranks) % left:
        return None
    cards = rank_gpus(k)
    failed = context.failed_local_rank
    cards.pop(failed if failed is not None and 0 <= failed < len(cards) else len(cards) - 1)
    gpus = "" if cards == list(range(left)) else ",".join(map(str, cards))
    # One rank left has nothing to shard with: it trains as one process.
    accum = k.grad_accum * ranks // left
    return dataclasses.replace(k, world_size=left, grad_accum=accum, gpus=gpus, fsdp=k.fsdp and ranks > 2)


_FREE, _SPEED, _QUALITY = CostClass.FREE, CostClass.THROUGHPUT, CostClass.QUALITY
#: Every rung, in the order the journal lists the rungs of a change.
RUNGS: tuple[Rung, ...] = (
    Rung("expandable_segments",
         "reserved-but-unallocated memory could have served the request: let the allocator grow segments",
         Survives.ALL, _set(expandable_segments=True), "expandable_segments",
         _FREE, Axis.TOGGLE, in_plan=True, tool_can_take=True),
    Rung("gradient_checkpointing", "recompute activations in backward instead of keeping them",
         Survives.ALL, _set(gradient_checkpointing=True), "gradient_checkpointing",
         _SPEED, Axis.EITHER, in_plan=True, tool_can_take=True),
    Rung("halve_micro_batch",
         "halve the micro-batch and double accumulation: same effective batch, half the activations",
         Survives.ALL, _halve_micro_batch, "micro_batch_size",
         _SPEED, Axis.DIVISORS, in_plan=True, tool_can_take=True),
    Rung("shorten_seq_len", "halve max_seq_len: activations grow with sequence length",
         Survives.ALL, _halve("max_seq_len", MIN_SEQ_LEN), "max_seq_len",
         _QUALITY, Axis.HALVINGS, 1.0, in_plan=True, tool_can_take=True),
    Rung("paged_8bit_optimizer",
         "8-bit paged AdamW: a quarter of the optimizer state, paged out under pressure",
         Survives.OPTIMIZER_RESET, _set(optimizer=PAGED_8BIT), "optimizer",
         _SPEED, Axis.TOGGLE, in_plan=True, tool_can_take=True),
    Rung("halve_lora_rank",
         "halve the LoRA rank (alpha with it): fewer trainable parameters and optimizer state; the "
         "adapter is cut to the new rank by truncated SVD of its trained update, so progress is kept",
         Survives.OPTIMIZER_RESET, _halve_lora_rank, "lora_r",
         _QUALITY, Axis.HALVINGS, 1.2, in_plan=True, tool_can_take=True),
    Rung("quantize_4bit", "load the base model in 4-bit NF4 with double quantization",
         Survives.ALL, _set(load_in_4bit=True, quant_type="nf4", double_quant=True), "load_in_4bit",
         tool_can_take=True, charged=False),
    # A throughput rung on the loss parity measured (H200 8B, 60 steps: within the noise of two
    # upcast runs; bench/results/throughput-h200-2026-12-01/parity.txt), but no speed: not FREE, so
    # a job that fits keeps its fp32 head. Our child, and a script through its shim.
    Rung("bf16_head",
         "keep the embeddings and LM head in bf16 instead of fp32 (norms stay fp32): half their bytes",
         Survives.ALL, _set(bf16_head=True), "bf16_head", _SPEED, Axis.TOGGLE, in_plan=True),
    Rung("activation_offload",
         "keep the activations saved for backward in host memory (save_on_cpu): slower, far less GPU memory",
         Survives.ALL, _set(activation_offload=True), "activation_offload",
         _SPEED, Axis.TOGGLE, in_plan=True),
    Rung("halve_eval_batch", "halve the evaluation batch",
         Survives.ALL, _halve("eval_batch_size", 1), "eval_batch_size",
         _SPEED, Axis.FITTED, in_plan=True, tool_can_take=True),
    Rung("disable_eval", "turn evaluation off", Survives.ALL, _set(eval_enabled=False), "eval_enabled",
         tool_can_take=True, charged=False),
    # The resume stage's rungs: our child loads the optimizer state itself; a tool's resume is its own.
    Rung("optimizer_state_on_host",
         "read the checkpoint's optimizer state into host memory and copy it to the card tensor by "
         "tensor, not onto the card whole (transformers does so under torchrun)",
         Survives.ALL, _optimizer_state_on_host, "optimizer_state_on_host"),
    Rung("fresh_optimizer_state",
         "resume the adapter and the step with a fresh optimizer state, the LR schedule kept at the "
         "step: the saved moments are not loaded",
         Survives.OPTIMIZER_RESET, _set(fresh_optimizer_state=True), "fresh_optimizer_state"),
    Rung("merge_on_cpu", "merge the adapter in a separate process on the CPU",
         Survives.ALL, _set(merge_on_cpu=True), "merge_on_cpu", charged=False),
    # The job's fallback models (the adapter starts again); the search tries them itself.
    Rung("smaller_model", "fall back to a smaller model",
         Survives.ADAPTER_REINIT, _smaller_model, "model", _QUALITY, quality_weight=5.0),
    # Under torchrun, for a card that keeps failing: the other cards (policies/decide.py).
    Rung("drop_rank",
         "one card keeps failing: restart on the remaining cards, accumulation raised to keep the "
         "effective batch (micro-batch x accumulation x ranks)",
         Survives.ALL, _drop_rank, "world_size", charged=False),
)  # fmt: skip

RUNG_BY_NAME: Mapping[str, Rung] = {rung.name: rung for rung in RUNGS}
#: Every rung name a job file may use in ``supervise.ladders``.
RUNG_NAMES: frozenset[str] = frozenset(RUNG_BY_NAME)
RUNG_CLASSES: Mapping[str, CostClass] = {r.name: r.cost for r in RUNGS if r.cost is not None}
#: Which rung a changed knob stands for, in the journal's words (the first rung over that knob).
RUNG_OF_KNOB: Mapping[str, str] = {r.knob: r.name for r in reversed(RUNGS) if r.charged}
#: The rungs ``plan`` shows, cheapest class first.
PLAN_RUNGS: tuple[Rung, ...] = tuple(r for cost in CostClass for r in RUNGS if r.in_plan and r.cost is cost)


def knob_changes(old: Knobs, new: Knobs) -> dict[str, tuple[Any, Any]]:
    """``{knob: (old, new)}`` for every knob that differs."""
    before, after = dataclasses.asdict(old), dataclasses.asdict(new)
    return {name: (before[name], after[name]) for name in before if before[name] != after[name]}


def rungs_between(old: Knobs, new: Knobs) -> tuple[str, ...]:
    """The rung names of every knob that differs, in the rungs' own order (one name per rung)."""
    changed = {RUNG_OF_KNOB[k] for k in knob_changes(old, new) if k in RUNG_OF_KNOB}
    return tuple(rung.name for rung in RUNGS if rung.name in changed)


#: Rungs that were, and why a job may no longer name them (the job file's validation says it).
RETIRED_RUNGS: Mapping[str, str] = {
    "cpu_offload": (
        "cpu_offload cannot train on one GPU: accelerate refuses to train 4-bit weights offloaded to "
        "the CPU, and bitsandbytes then fails on meta tensors (Tensor.item() cannot be called on meta "
        "tensors); use activation_offload (saved activations in host memory) or bf16_head instead"
    ),
}


def rung_by_name(name: str, context: RungContext = RungContext()) -> Rung:
    """The rung called ``name``, bound to what it may need beyond the knobs."""
    return dataclasses.replace(RUNG_BY_NAME[name], context=context)


#: Under torchrun, for a card that keeps failing (a fatal Xid, a fault that came back, contention
#: that outlasted the wait): the other cards, with accumulation raised (policies/decide.py).
CARD_FAILING: tuple[str, ...] = ("drop_rank",)
#: Default ladders: for each failure kind, the rungs to try in order (a job may override any). The
#: cheapest change that keeps all progress first, those that reset the optimizer or the adapter last,
#: a smaller model as the last resort.
DEFAULT_LADDERS: Mapping[FailureKind, tuple[str, ...]] = {
    FailureKind.OOM_FORWARD: (
        "gradient_checkpointing",
        "halve_micro_batch",
        "activation_offload",
        "shorten_seq_len",
        "smaller_model",
    ),
    FailureKind.OOM_BACKWARD: (
        "gradient_checkpointing",
        "paged_8bit_optimizer",
        "halve_micro_batch",
        "activation_offload",
        "halve_lora_rank",
        "shorten_seq_len",
        "smaller_model",
    ),
    FailureKind.OOM_OPTIMIZER: ("paged_8bit_optimizer", "halve_lora_rank", "smaller_model"),
    # No CPU offload of weights: accelerate refuses to train 4-bit weights offloaded to the CPU and
    # bitsandbytes then fails on meta tensors (issue 19's dead end), so the head in bf16 comes next.
    FailureKind.OOM_LOAD: ("quantize_4bit", "bf16_head", "smaller_model"),
    # Loading the resume checkpoint's state (issue 33): through the host, then a fresh optimizer state,
    # then the paged 8-bit optimizer (its moments start afresh too); the adapter and the step survive.
    FailureKind.OOM_RESUME: ("optimizer_state_on_host", "fresh_optimizer_state", "paged_8bit_optimizer"),
    FailureKind.OOM_EVAL: ("halve_eval_batch", "disable_eval"),
    FailureKind.OOM_MERGE: ("merge_on_cpu",),
}
#: Kinds whose ladder is "their own fix first, then the ladder of the stage they happened in".
STAGE_DEPENDENT: Mapping[FailureKind, tuple[str, ...]] = {
    FailureKind.OOM_FRAGMENTATION: ("expandable_segments",),
    # Host RAM ran out: the stage's ladder shrinks host-side activations just as it does GPU ones.
    FailureKind.HOST_OOM: (),
    # Reached only when the job allows degrading on contention (otherwise the policy waits).
    FailureKind.OOM_CONTENTION: (),
}


def ladder_for(
    kind: FailureKind, stage: Stage, overrides: Mapping[FailureKind, tuple[str, ...]] | None = None
) -> tuple[str, ...]:
    """The rung names to try for a failure of ``kind`` that happened in ``stage``."""
    overrides = overrides or {}
    if kind in overrides:
        return overrides[kind]
    if kind in STAGE_DEPENDENT:
        stage_kind = OOM_KIND_BY_STAGE.get(stage, FailureKind.OOM_FORWARD)
        stage_ladder = overrides.get(stage_kind, DEFAULT_LADDERS[stage_kind])
        return tuple(dict.fromkeys(STAGE_DEPENDENT[kind] + stage_ladder))
    return DEFAULT_LADDERS.get(kind, ())
