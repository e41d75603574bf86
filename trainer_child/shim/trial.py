"""The speed trial on a foreign tool's own Trainer. A trial that cannot time the tool's batches (no
tokenized row, axolotl's sample packing, offloading in the tool's own training step, a loss or
collator that refuses the trial's batch) keeps the plan and says why, rather than failing.
"""

from __future__ import annotations

import gc
from typing import Any

from qlora_supervise.trainer_child.contract.events import SpeedTrialEvent
from qlora_supervise.trainer_child.contract.spec import AttemptSpec
from qlora_supervise.trainer_child.run import speed_trial
from qlora_supervise.trainer_child.run.heartbeat import Progress


def run(trainer: Any, spec: AttemptSpec, progress: Progress, on_cuda: bool) -> SpeedTrialEvent:
    """Time the spec's candidates on ``trainer`` and train with the choice; or keep the plan, saying why."""
    began = speed_trial.Began.now(progress, trainer)
    why = cannot_time(trainer)
    row: dict[str, Any] | None = None
    if why is None:
        try:
            row = tool_row(trainer)
        except Exception as exc:  # not a dataset the trial can read: the plan stays
            why = f"no tokenized training row to time ({_said(exc)})"
    results = None
    if row is not None:
        try:  # the timing alone: the policy's choice, applied after it, is our own code
            results = speed_trial.time_all(trainer, spec, on_cuda, row)
        except Exception as exc:  # the tool's loss or collator on the trial's batch
            why = f"the tool's Trainer did not take the trial's batch ({_said(exc)})"
        gc.collect()  # a traceback's frames held the failed micro-step's tensors
    if results is not None:
        return speed_trial.conclude(trainer, progress, on_cuda, results, began)
    return speed_trial.abandon(trainer, progress, on_cuda, why or "nothing to time", began)


def cannot_time(trainer: Any) -> str | None:
    """Why the trial cannot time this Trainer's batches, or None."""
    args = trainer.args
    if getattr(args, "sample_packing", False):
        return "axolotl's sample_packing: its batches are packed per micro-batch"
    offloads = [name for name in ("activation_offloading", "layer_offloading") if getattr(args, name, False)]
    if offloads:
        named = ", ".join(offloads)
        return f"the tool offloads in its own training step ({named}): the trial would measure without it"
    if getattr(trainer, "train_dataset", None) is None:
        return "the Trainer has no train_dataset"
    return None


def tool_row(trainer: Any) -> dict[str, Any]:
    """The longest training row, with the columns the Trainer's own dataloader would keep."""
    row = speed_trial.longest_row(trainer.train_dataset)
    kept = kept_columns(trainer)
    return row if kept is None else {k: v for k, v in row.items() if k in kept}


def kept_columns(trainer: Any) -> set[str] | None:
    """The columns ``remove_unused_columns`` keeps, as the Trainer finds them; None: every one."""
    if not getattr(trainer.args, "remove_unused_columns", False):
        return None
    find = getattr(trainer, "_set_signature_columns_if_needed", None)
    if find is None:
        return None
    find()
    signature = getattr(trainer, "_signature_columns", None)
    return set(signature) if signature else None


def _said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"
