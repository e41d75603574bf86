"""The speed trial in a foreign tool's process: our child's trial, on the tool's own Trainer.

The shim runs it where our child does, after the Trainer is built and before ``train()`` builds the
dataloader (:meth:`.session.Session.train`), for a fresh attempt whose spec lists candidates. What
differs from our child is what we cannot know about the tool in advance, so each is checked here,
and a trial that cannot time its candidates keeps the plan and says why (the ``speed_trial``
event's ``abandoned``), rather than failing an attempt that would have trained:

* **The row.** Our child's dataset is trl's, tokenized. A tool's may be another library's or not
  an Arrow dataset at all; the longest row is read as for our child where it can be, and reduced to
  the columns the Trainer itself would keep (``remove_unused_columns``: the model's ``forward``
  arguments and the label names), so the tool's collator sees what its dataloader would give it.
* **The batches.** axolotl's sample packing packs rows into each micro-batch by length
  (its multipack sampler), so a row repeated to a micro-batch is not a batch it would train on,
  and the packing plan belongs to the micro-batch it was made for: no trial there.
* **Offloading in the tool's own training step** (trl's and axolotl's ``activation_offloading``,
  axolotl's ``layer_offloading``): the trial's micro-step is the Trainer's ``compute_loss`` and
  backward, without the tool's wrapper, so it would measure a config that does not train.
* **Anything else the tool's ``compute_loss`` or collator raises** on the trial's batch (an OOM is
  the trial's own business: that candidate is dropped, as in our child). Checkpointing is then
  put back as the trial found it, on the model and in the arguments.
"""

from __future__ import annotations

import gc
from typing import Any

from qlora_supervise.trainer_child.contract.spec import AttemptSpec
from qlora_supervise.trainer_child.contract.speed_trial import SpeedTrialEvent
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
        try:  # the timing alone: what follows it (the policy's choice, applied) is the trial's own code
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
    # The tool's own training_step wraps each micro-step in these; the trial's micro-step (the
    # Trainer's compute_loss and backward) would time and measure without them.
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
    """The columns ``remove_unused_columns`` keeps (None: it keeps every one, or the Trainer does not
    say), as transformers' ``Trainer._remove_unused_columns`` finds them: the model's ``forward``
    arguments and the label names (a tool's Trainer may add its own, as trl's does)."""
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
