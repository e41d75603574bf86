"""Approach (c): the same QLoRA recipe in one process with transformers' ``auto_find_batch_size``.

    python -m bench.recovery.auto_batch --spec attempt-001/spec.json

Run by :mod:`recovery.approaches` with the same spec (knobs, data, recipe settings, memory cap,
device, allocator environment) the restart loop gives our trainer child. The recipe is built by
the trainer child's own functions (``recipe.load_model`` → 4-bit NF4, double quant, bf16 compute,
``use_cache=False``; ``recipe.add_lora`` → ``prepare_model_for_kbit_training`` + LoRA;
``recipe.sft_config`` → the same SFTConfig: optimizer, seq, micro-batch, accumulation, schedule,
``save_steps``), so the only difference is the trainer: trl's plain ``SFTTrainer`` with
``auto_find_batch_size=True`` instead of our supervised one.

What ``auto_find_batch_size`` does (transformers 5 ``Trainer.train`` with accelerate's
``find_executable_batch_size``): the whole inner training loop is wrapped; an exception that
``accelerate.utils.should_reduce_batch_size`` calls an OOM (a ``RuntimeError`` whose one argument
holds " out of memory." or "DefaultCPUAllocator: can't allocate memory") frees the cache and runs
the loop again with the batch size times 0.9, rounded down (4 → 3 → 2 → 1, then "No executable
batch size found, reached zero"). ``gradient_accumulation_steps`` is not changed, so the
effective batch shrinks with it; the new loop starts from step 0 with a fresh optimizer and
schedule (the adapter keeps whatever the failed loop's steps did to it). An eval OOM is re-raised.

The events file (``spec.events_file``) gets the child's ``started`` line (the child's own setup:
caps, imports) and ``heartbeat`` lines per optimizer step in the child's format, plus this
script's ``try_started`` (batch size, accumulation), ``try_failed`` (step, error) and
``finished`` / ``gave_up``. Exit 0 when training finished, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from pathlib import Path
from typing import Any


def trainer_class() -> type:
    """trl's SFTTrainer, instrumented: one ``try_started``/``try_failed`` per batch size tried, a
    heartbeat per optimizer step with its tokens/s. Nothing here changes what it trains."""
    from accelerate.utils.memory import should_reduce_batch_size
    from trl import SFTTrainer

    from qlora_supervise.trainer_child.contract.codes import Stage
    from qlora_supervise.trainer_child.run.heartbeat import Progress

    class AutoBatchSFTTrainer(SFTTrainer):
        def __init__(self, *args: Any, progress: Progress, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.progress = progress
            self.step_tokens = 0
            self.step_started = time.monotonic()

        def _inner_training_loop(self, batch_size: int | None = None, *args: Any, **kwargs: Any) -> Any:
            accum = self.args.gradient_accumulation_steps
            self.progress.events.emit("try_started", batch_size=batch_size, grad_accum=accum)
            self.progress.enter(Stage.FORWARD)  # the heartbeats' stage: in the training loop
            self.step_tokens, self.step_started = 0, time.monotonic()
            try:
                return super()._inner_training_loop(batch_size, *args, **kwargs)
            except Exception as exc:
                self.progress.events.emit(
                    "try_failed",
                    batch_size=batch_size,
                    step=self.state.global_step,
                    retried=should_reduce_batch_size(exc),
                    error=f"{type(exc).__name__}: {str(exc)[:500]}",
                )
                raise

        def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
            mask = inputs.get("attention_mask")
            self.step_tokens += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
            # trl leaves training_step unannotated (pyproject's trainer override says the same).
            return super().training_step(model, inputs, *args, **kwargs)  # type: ignore[no-untyped-call]

        def end_step(self) -> None:
            now = time.monotonic()
            self.progress.step = self.state.global_step
            self.progress.tokens_per_s = self.step_tokens / max(now - self.step_started, 1e-9)
            self.step_tokens, self.step_started = 0, now
            self.progress.heartbeat()

    return AutoBatchSFTTrainer


def step_callback(trainer: Any) -> Any:
    from transformers import TrainerCallback

    class StepBeat(TrainerCallback):
        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            trainer.end_step()

    return StepBeat()


def train(spec_path: Path) -> int:
    """Set up as our child does, then :func:`run`; any failure is logged as ``gave_up``."""
    from qlora_supervise.trainer_child.__main__ import prepare_env, read_spec

    spec = read_spec(spec_path)
    prepare_env(spec)  # offline hub, the one visible device, allocator settings: before torch
    from qlora_supervise.trainer_child.run import attempt

    ctx = attempt.Context(spec)
    try:
        return run(ctx)
    except Exception as exc:  # the approach gave up (or never started): say why, as the table reports it
        traceback.print_exc()
        ctx.events.emit("gave_up", step=ctx.progress.step, error=f"{type(exc).__name__}: {exc}"[:800])
        return 1


def run(ctx: Any) -> int:
    """The child's setup, the recipe, and training with ``auto_find_batch_size``."""
    from qlora_supervise.trainer_child.contract.codes import Stage
    from qlora_supervise.trainer_child.recipe import data
    from qlora_supervise.trainer_child.recipe import qlora as recipe
    from qlora_supervise.trainer_child.run import attempt

    spec, progress = ctx.spec, ctx.progress
    attempt.setup(ctx)  # the GPU cap, the imports, ``started``, then the CPU cap
    dtype = recipe.compute_dtype(spec.train.compute_dtype, ctx.on_cuda)
    progress.enter(Stage.LOAD)
    tokenizer = data.load_tokenizer(spec)
    model = recipe.add_lora(recipe.load_model(spec, dtype, ctx.on_cuda), spec.knobs, spec)
    train_set, _ = data.train_eval_split(spec.data, tokenizer, spec.train.seed)
    config = recipe.sft_config(spec, dtype, ctx.on_cuda, has_eval=False)
    config.auto_find_batch_size = True  # the one change: the approach under test
    trainer = trainer_class()(
        model=model, args=config, train_dataset=train_set, processing_class=tokenizer, progress=progress
    )
    trainer.add_callback(step_callback(trainer))
    trainer.train()
    ctx.events.emit("finished", step=trainer.state.global_step, batch_size=trainer._train_batch_size)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, required=True, help="an AttemptSpec (trainer_child/contract/)")
    return train(parser.parse_args(argv).spec)


if __name__ == "__main__":
    sys.exit(main())
