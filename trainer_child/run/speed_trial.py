"""Speed trial: the planner's candidates timed in-process before step 1, training with the fastest; only from
step 0 (or a re-time), with two or more candidates, in one process. Each runs a warm-up and a few timed
forward+backward micro-steps on the longest sample (repeated to its micro-batch), its checkpointing switched
on the same model: no reload, no optimizer step. The training that follows is the one it would have been: no
dataloader exists yet; RNG states, gradients and trl's metrics are put back. An OOM drops the candidate where
it failed. The choice is the policy's (:func:`policies.choice.after_trial`), applied here."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from qlora_supervise.policies import choice
from qlora_supervise.trainer_child.contract.codes import Stage
from qlora_supervise.trainer_child.contract.events import SpeedTrialEvent, TrialResult
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, Knobs, TrialCandidate
from qlora_supervise.trainer_child.recipe import activations
from qlora_supervise.trainer_child.run import failure, memory, torchrun
from qlora_supervise.trainer_child.run.heartbeat import Progress

#: The whole trial's aim, warm-ups included, shared by the candidates (each has a warm-up, MIN_TIMED_STEPS).
BUDGET_S = 10.0
MIN_TIMED_STEPS = 1
MAX_TIMED_STEPS = 4


def wanted(spec: AttemptSpec, resuming: bool) -> bool:
    from_here = not resuming or spec.speed_trial_on_resume
    return len(spec.speed_trial) >= 2 and from_here and not torchrun.this_rank().distributed


def run(trainer: Any, spec: AttemptSpec, progress: Progress, on_cuda: bool) -> SpeedTrialEvent:
    """Time ``spec.speed_trial`` on the longest training row, apply the choice, emit and return the event."""
    began = Began.now(progress, trainer)
    row = longest_row(trainer.train_dataset)
    return conclude(trainer, progress, on_cuda, time_all(trainer, spec, on_cuda, row), began)


def time_all(trainer: Any, spec: AttemptSpec, on_cuda: bool, row: dict[str, Any]) -> tuple[TrialResult, ...]:
    share = BUDGET_S / len(spec.speed_trial)
    with untouched(trainer):
        results = tuple(time_candidate(trainer, row, c, on_cuda, share) for c in spec.speed_trial)
    return tuple(choice.within(r, spec.speed_trial_limit_bytes) for r in results)


def conclude(
    trainer: Any, progress: Progress, on_cuda: bool, results: tuple[TrialResult, ...], began: Began
) -> SpeedTrialEvent:
    chosen = choice.after_trial(trainer.plan.knobs, results)
    apply(trainer, chosen.knobs)
    event = SpeedTrialEvent(results, round(time.monotonic() - began.time, 3))
    return _ended(event, progress, began.stage, on_cuda, summary(event, chosen))


def abandon(trainer: Any, progress: Progress, on_cuda: bool, why: str, began: Began) -> SpeedTrialEvent:
    """End an untimed trial: checkpointing as found, no gradients, an event saying why; the plan stands."""
    began.restore(trainer)
    trainer.model.zero_grad(set_to_none=True)
    event = SpeedTrialEvent((), round(time.monotonic() - began.time, 3), why)
    line = f"speed trial abandoned ({why}): training as planned"
    return _ended(event, progress, began.stage, on_cuda, line)


#: The arguments' names for checkpointing (transformers 5's, and its deprecated alias).
_CHECKPOINTING_ARGS = ("activation_checkpointing", "gradient_checkpointing")


@dataclasses.dataclass(frozen=True)
class Began:
    """When a trial began, the stage it hands back, and checkpointing as it found it on the model (a
    tool may switch it there against its arguments, as axolotl does) and in the arguments."""

    time: float
    stage: Stage
    model_checkpointing: bool | None = None
    args_checkpointing: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def now(cls, progress: Progress, trainer: Any) -> Began:
        args = tuple(
            (name, getattr(trainer.args, name)) for name in _CHECKPOINTING_ARGS if hasattr(trainer.args, name)
        )
        return cls(time.monotonic(), progress.stage, model_checkpointing(trainer), args)

    def restore(self, trainer: Any) -> None:
        if self.model_checkpointing is not None and model_checkpointing(trainer) != self.model_checkpointing:
            activations.set_checkpointing(trainer, self.model_checkpointing)
        for name, value in self.args_checkpointing:
            setattr(trainer.args, name, value)


def model_checkpointing(trainer: Any) -> bool | None:
    """Whether checkpointing is on in the model itself (None: it does not say)."""
    model = trainer.model.get_base_model() if hasattr(trainer.model, "get_base_model") else trainer.model
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(model), name):
            return bool(getattr(model, name))
    return None


def _ended(
    event: SpeedTrialEvent, progress: Progress, before: Stage, on_cuda: bool, line: str
) -> SpeedTrialEvent:
    activations.release_host_buffers()
    memory.free_memory()
    if on_cuda:  # from here the attempt's peaks are its training's, not the trial's
        torch.cuda.reset_peak_memory_stats()
        memory.reset_host_peak()
    progress.enter(before)
    progress.events.write(event.to_line())
    print(line, flush=True)
    return event


def longest_row(dataset: Any) -> dict[str, Any]:
    """The sample with the most tokens (as trl tokenized, truncated), read via Arrow: no list per row."""
    import pyarrow.compute as pc

    column = dataset.select_columns(["input_ids"]).with_format("arrow")[:]["input_ids"]
    lengths = pc.list_value_length(column)
    row: dict[str, Any] = dataset[int(pc.index(lengths, pc.max(lengths)).as_py())]
    return row


def time_candidate(
    trainer: Any, row: dict[str, Any], candidate: TrialCandidate, on_cuda: bool, share: float
) -> TrialResult:
    """Warm-up, then timed micro-steps until ``share`` seconds are spent (within the step limits); an
    OOM ends the candidate with its ``error`` (handled outside ``except``, whose frames hold tensors)."""
    started = time.monotonic()
    activations.set_checkpointing(trainer, candidate.gradient_checkpointing)
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    measured_host = memory.reset_host_peak()
    tokens_per_s: float | None = None
    error: str | None = None
    try:
        batch = trainer._prepare_inputs(trainer.data_collator([row] * candidate.micro_batch_size))
        tokens_per_s = timed_steps(trainer, batch, on_cuda, started + share)
    except Exception as exc:
        if not failure.is_oom(exc):
            raise
        error = f"{type(exc).__name__}: {str(exc)[:300]}"
    batch = None  # the activations of a failed step went with the exception; the batch goes here
    trainer.model.zero_grad(set_to_none=True)
    host_peak = memory.proc_status_bytes("VmHWM") if measured_host else None
    activations.release_host_buffers()  # the next candidate saves other sizes
    if error is not None:
        memory.free_memory()
    seconds = round(time.monotonic() - started, 3)
    # The CUDA allocator's peak since the start; on the CPU the data segment's so far (never reset).
    peak = int(torch.cuda.max_memory_allocated()) if on_cuda else memory.memory_numbers().peak_bytes
    return TrialResult(candidate, tokens_per_s, peak, seconds, error, host_peak)


def timed_steps(trainer: Any, batch: dict[str, Any], on_cuda: bool, deadline: float) -> float:
    """Tokens per second over the timed micro-steps, after one warm-up (kernel choice, allocator)."""
    mask = batch.get("attention_mask")
    tokens = int(mask.sum()) if mask is not None else int(batch["input_ids"].numel())
    micro_step(trainer, batch, on_cuda)
    steps, start = 0, time.monotonic()
    while steps < MIN_TIMED_STEPS or (steps < MAX_TIMED_STEPS and time.monotonic() < deadline):
        micro_step(trainer, batch, on_cuda)
        steps += 1
    return tokens * steps / max(time.monotonic() - start, 1e-9)


def micro_step(trainer: Any, batch: dict[str, Any], on_cuda: bool) -> None:
    """One forward+backward as ``training_step`` runs it (with the autocast ``train()`` would wrap the
    forward in, not applied yet), synchronized; the gradients accumulate, nothing steps."""
    model = trainer.model
    model.train()
    with activations.activation_context(trainer.plan.knobs):
        with trainer.accelerator.autocast(), trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, dict(batch))
        trainer.accelerator.backward(loss)
    if on_cuda:
        torch.cuda.synchronize()


def apply(trainer: Any, knobs: Knobs) -> None:
    """Train with ``knobs``, before ``train()`` (its dataloader reads ``_train_batch_size``, set at init)."""
    args = trainer.args
    args.per_device_train_batch_size = knobs.micro_batch_size
    args.gradient_accumulation_steps = knobs.grad_accum
    trainer._train_batch_size = args.train_batch_size
    activations.set_checkpointing(trainer, knobs.gradient_checkpointing)
    trainer.plan = dataclasses.replace(trainer.plan, knobs=knobs)


@contextlib.contextmanager
def untouched(trainer: Any) -> Iterator[None]:
    """Put back what the micro-steps change besides the gradients: the RNG states, the train/eval mode
    and trl's metrics (which the first logged step would otherwise average in)."""
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


def summary(event: SpeedTrialEvent, chosen: choice.TrialChoice) -> str:
    """One line for child.log: each candidate's tokens/s (or why it was dropped) and the choice."""
    rows = [f"{r.candidate.name}: {_outcome(r)}" for r in event.results]
    return f"speed trial ({event.seconds:.1f} s): {'; '.join(rows)} -> {chosen.why}"


def _outcome(result: TrialResult) -> str:
    if result.tokens_per_s is None:
        return "dropped (OOM)"
    measured = f"{result.tokens_per_s:.0f} tokens/s"
    if result.host_peak_bytes is not None:
        measured += f", host {result.host_peak_bytes / (1 << 30):.2f} GiB"
    return measured if result.error is None else f"{measured}, dropped: {result.error}"
