"""Default ladders: for each failure kind, the rungs to try in order (a job may override any).
The cheapest change that keeps all progress first, those that reset the optimizer or the adapter
last, a smaller model as the last resort."""

from __future__ import annotations

from collections.abc import Mapping

from qlora_supervise.trainer_child.contract.codes import OOM_KIND_BY_STAGE, FailureKind, Stage

#: Under torchrun, for a card that keeps failing (a fatal Xid, a fault that came back, contention
#: that outlasted the wait): the other cards, with accumulation raised (policies/decide.py).
CARD_FAILING: tuple[str, ...] = ("drop_rank",)
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
