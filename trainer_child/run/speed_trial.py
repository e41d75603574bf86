"""The speed trial: time the planner's candidates in-process before step 1, train with the fastest.

Once the trainer is built, and only for an attempt that starts at step 0 with two or more
candidates in its spec (:mod:`...contract.spec`; the first is the spec's own knobs), each
candidate runs a warm-up and a few timed forward+backward micro-steps on the longest real sample of
the training data (repeated to the candidate's micro-batch, so every row has the longest length),
with its checkpointing switched on the same model: no reload, no optimizer step.

The training it precedes is the one it would have been without it: the data iterator does not
exist yet (Trainer builds its dataloader inside ``train()``), the Python, NumPy, torch and CUDA RNG
states (LoRA dropout draws from torch's) are restored afterwards, the gradients are dropped, and
trl's logged metrics are put back. A candidate that runs out of memory is dropped where it failed
(freed, no restart); the trial then goes on with the next.

The choice is the policy's (:func:`policies.choice.after_trial`, the one place that decides the
config; this module only times and applies), applied to the trainer's arguments before
``train()`` reads them: ``per_device_train_batch_size`` (Trainer copies it into
``_train_batch_size`` at construction, and its dataloader reads that copy),
``gradient_accumulation_steps`` (read in ``train()``), and checkpointing on the model and in the
arguments (:func:`recipe.activations.set_checkpointing`). One ``speed_trial`` event reports the
timings and the trial's cost; the supervisor asks the policy the same question of them. Not under
torchrun: the ranks would time and choose apart.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from qlora_supervise.policies import choice
from qlora_supervise.policies.choice import TrialChoice
from qlora_supervise.trainer_child.contract.codes import Stage
from qlora_supervise.trainer_child.contract.events import SpeedTrialEvent, TrialResult
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, Knobs, TrialCandidate
from qlora_supervise.trainer_child.recipe.activations import (
    activation_context,
    release_host_buffers,
    set_checkpointing,
)
from qlora_supervise.trainer_child.run.failure import is_oom
from qlora_supervise.trainer_child.run.heartbeat import Progress
from qlora_supervise.trainer_child.run.memory import memory_numbers, proc_status_bytes, reset_host_peak
from qlora_supervise.trainer_child.run.torchrun import this_rank

#: The whole trial's aim on a GPU, warm-ups included, shared out among the candidates; a
#: candidate still gets its warm-up and :data:`MIN_TIMED_STEPS` when its share is spent.
BUDGET_S = 10.0
MIN_TIMED_STEPS = 1
MAX_TIMED_STEPS = 4


def wanted(spec: AttemptSpec, resuming: bool) -> bool:
    """Whether this attempt runs a trial: two or more candidates, from step 0 (or a re-time), one process."""
    from_here = not resuming or spec.speed_trial_on_resume
    return len(spec.speed_trial) >= 2 and from_here and not this_rank().distributed


def run(
    trainer: Any, spec: AttemptSpec, progress: Progress, on_cuda: bool, row: dict[str, Any] | None = None
) -> SpeedTrialEvent:
    """Time ``spec.speed_trial``, apply the choice to ``trainer``, emit and return the event.

    ``row``: the sample to time (default: the longest of the training data, as our trainer holds it).
    """
    began = Began.now(progress, trainer)
    row = longest_row(trainer.train_dataset) if row is None else row
    return conclude(trainer, progress, on_cuda, time_all(trainer, spec, on_cuda, row), began)


def time_all(trainer: Any, spec: AttemptSpec, on_cuda: bool, row: dict[str, Any]) -> tuple[TrialResult, ...]:
    """Each candidate timed on ``row`` (an OOM drops it), then held to the plan's limit."""
    share = BUDGET_S / len(spec.speed_trial)
    with untouched(trainer):
        results = tuple(time_candidate(trainer, row, c, on_cuda, share) for c in spec.speed_trial)
    return tuple(choice.within(r, spec.speed_trial_limit_bytes) for r in results)


def conclude(
    trainer: Any, progress: Progress, on_cuda: bool, results: tuple[TrialResult, ...], began: Began
) -> SpeedTrialEvent:
    """Train with the policy's choice among ``results``: apply it, emit the timings."""
    chosen = choice.after_trial(trainer.plan.knobs, results)
    apply(trainer, chosen.knobs)
    event = SpeedTrialEvent(results, round(time.monotonic() - began.time, 3))
    return _ended(event, progress, began.stage, on_cuda, summary(event, chosen))


def abandon(trainer: Any, progress: Progress, on_cuda: bool, why: str, began: Began) -> SpeedTrialEvent:
    """End a trial that could not time its candidates: checkpointing as the trial found it (on the
    model and in the arguments), no gradients, and an event that says why and keeps the plan."""
    began.restore(trainer)
    trainer.model.zero_grad(set_to_none=True)
    event = SpeedTrialEvent((), round(time.monotonic() - began.time, 3), why)
    line = f"speed trial abandoned ({why}): training as planned"
    return _ended(event, progress, began.stage, on_cuda, line)


#: The arguments' names for checkpointing (transformers 5's, and its deprecated alias).
_CHECKPOINTING_ARGS = ("activation_checkpointing", "gradient_checkpointing")


@dataclasses.dataclass(frozen=True)
class Began:
    """When a trial began, the stage it hands back, and checkpointing as it found it: on the model
    (a tool may switch it there while its arguments say otherwise, as axolotl's loader does) and in
    the arguments."""

    time: float
    stage: Stage
    model_checkpointing: bool | None = None
    args_checkpointing: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def now(cls, progress: Progress, trainer: Any = None) -> Began:
        if trainer is None:
            return cls(time.monotonic(), progress.stage)
        args = tuple(
            (name, getattr(trainer.args, name)) for name in _CHECKPOINTING_ARGS if hasattr(trainer.args, name)
        )
        return cls(time.monotonic(), progress.stage, model_checkpointing(trainer), args)

    def restore(self, trainer: Any) -> None:
        """Checkpointing back to what the trial found, where a candidate changed it."""
        if self.model_checkpointing is not None and model_checkpointing(trainer) != self.model_checkpointing:
            set_checkpointing(trainer, self.model_checkpointing)
        for name, value in self.args_checkpointing:
            setattr(trainer.args, name, value)


def model_checkpointing(trainer: Any) -> bool | None:
    """Whether checkpointing is on in the model itself (None: the model does not say)."""
    model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return None


def _ended(
    event: SpeedTrialEvent, progress: Progress, before: Stage, on_cuda: bool, line: str
) -> SpeedTrialEvent:
    release_host_buffers()  # pinned offload buffers the trial's candidates left: back to the system
    free(on_cuda)
    if on_cuda:  # from here the attempt's peak is its training's (the chosen config's), not the trial's
        torch.cuda.reset_peak_memory_stats()
        reset_host_peak()  # and its host peak too
    progress.enter(before)
    progress.events.write(event.to_line())
    print(line, flush=True)
    return event


def longest_row(dataset: Any) -> dict[str, Any]:
    """The training sample with the most tokens (trl has tokenized and truncated it to max_length).

    Read through Arrow, the input_ids column only: no Python list per row of a large dataset.
    """
    import pyarrow.compute as pc

    column = dataset.select_columns(["input_ids"]).with_format("arrow")[:]["input_ids"]
    lengths = pc.list_value_length(column)
    index = pc.index(lengths, pc.max(lengths)).as_py()
    row: dict[str, Any] = dataset[int(index)]
    return row


def time_candidate(
    trainer: Any, row: dict[str, Any], candidate: TrialCandidate, on_cuda: bool, share: float
) -> TrialResult:
    """Warm-up, then timed micro-steps until ``share`` seconds are spent (within the step limits);
    an OOM ends the candidate with its ``error`` (handled outside ``except``: the traceback's
    frames hold the activations to free)."""
    started = time.monotonic()
    set_checkpointing(trainer, candidate.gradient_checkpointing)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    measured_host = reset_host_peak()
    tokens_per_s: float | None = None
    error: str | None = None
    try:
        batch = trainer._prepare_inputs(trainer.data_collator([row] * candidate.micro_batch_size))
        tokens_per_s = timed_steps(trainer, batch, on_cuda, started + share)
    except Exception as exc:
        if not is_oom(exc):
            raise
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    batch = None  # the activations of a failed step went with the exception; the batch goes here
    trainer.model.zero_grad(set_to_none=True)
    host_peak = proc_status_bytes("VmHWM") if measured_host else None
    # The next candidate saves other sizes: this one's offload buffers go back to the system.
    release_host_buffers()
    if error is not None:
        free(on_cuda)
    seconds = round(time.monotonic() - started, 3)
    return TrialResult(candidate, tokens_per_s, peak(on_cuda), seconds, error, host_peak)


def timed_steps(trainer: Any, batch: dict[str, Any], on_cuda: bool, deadline: float) -> float:
    """Tokens per second over the timed micro-steps, after one warm-up (kernel choice, allocator)."""
    mask = batch.get("attention_mask")
    tokens = int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())
    micro_step(trainer, batch)
    sync(on_cuda)
    steps, start = 0, time.monotonic()
    while steps < MIN_TIMED_STEPS or (steps < MAX_TIMED_STEPS and time.monotonic() < deadline):
        micro_step(trainer, batch)
        sync(on_cuda)
        steps += 1
    return tokens * steps / max(time.monotonic() - start, 1e-9)


def micro_step(trainer: Any, batch: dict[str, Any]) -> None:
    """One forward+backward as ``training_step`` runs it: the trainer's loss, the autocast that
    accelerate's ``prepare`` would wrap the forward in (not applied yet: ``train()`` does it), the
    activation context, the accelerator's backward; the gradients accumulate, nothing steps."""
    model = trainer.model
    model.train()
    with activation_context(trainer.plan.knobs):
        with trainer.accelerator.autocast(), trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, dict(batch))
        trainer.accelerator.backward(loss)


def apply(trainer: Any, knobs: Knobs) -> None:
    """Train with ``knobs``: micro-batch, accumulation, checkpointing, and the checkpoints' record."""
    args = trainer.args
    args.per_device_train_batch_size = knobs.micro_batch_size
    args.gradient_accumulation_steps = knobs.grad_accum
    trainer._train_batch_size = args.train_batch_size
    set_checkpointing(trainer, knobs.gradient_checkpointing)
    trainer.plan = dataclasses.replace(trainer.plan, knobs=knobs)


@contextlib.contextmanager
def untouched(trainer: Any) -> Iterator[None]:
    """Put back what the trial's micro-steps change besides the gradients: the RNG states, the
    model's train/eval mode and trl's metrics (its compute_loss appends entropy, accuracy and the
    token count, which the first logged step would otherwise average in)."""
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    metrics = copy.deepcopy(getattr(trainer, "_metrics", None))
    train_tokens = getattr(trainer, "_total_train_tokens", None)
    training = trainer.model.training
    try:
        yield
    finally:
        random.setstate(states[0])
        np.random.set_state(states[1])
        torch.set_rng_state(states[2])
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)
        if metrics is not None:
            trainer._metrics = metrics
        if train_tokens is not None:
            trainer._total_train_tokens = train_tokens
        trainer.model.train(training)


def peak(on_cuda: bool) -> int | None:
    """The candidate's peak: the CUDA allocator's since its start; on the CPU the data segment's
    high-water mark of the process so far (it cannot be reset, so it never falls between rows)."""
    if on_cuda:
        return int(torch.cuda.max_memory_allocated())
    return memory_numbers().peak_bytes


def sync(on_cuda: bool) -> None:
    if on_cuda:
        torch.cuda.synchronize()


def free(on_cuda: bool) -> None:
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()


def summary(event: SpeedTrialEvent, chosen: TrialChoice) -> str:
    """One line for child.log: each candidate's tokens/s (or why it was dropped), and the choice."""
    rows = [f"{r.candidate.name}: {_outcome(r)}" for r in event.results]
    return f"speed trial ({event.seconds:.1f} s): {'; '.join(rows)} -> {chosen.why}"


def _outcome(result: TrialResult) -> str:
    if result.tokens_per_s is None:
        return "dropped (OOM)"
    measured = f"{result.tokens_per_s:.0f} tokens/s"
    if result.host_peak_bytes is not None:
        measured += f", host {result.host_peak_bytes / (1 << 30):.2f} GiB"
    return measured if result.error is None else f"{measured}, dropped: {result.error}"
