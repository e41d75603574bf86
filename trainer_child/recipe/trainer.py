"""SFTTrainer with stage tracking, atomic and emergency checkpoints, resume loading and graceful stop.
Stages are set where the work starts: ``compute_loss`` (forward), ``accelerator.backward`` (backward,
clipping included), ``on_pre_optimizer_step`` (optimizer), ``evaluate``, ``_save_checkpoint`` (save);
never reset in a ``finally``: after an exception the stage must say where it came from."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import Trainer, TrainerCallback
from trl import SFTTrainer

from qlora_supervise.trainer_child.contract import checkpoints, disk_space, durable, events
from qlora_supervise.trainer_child.contract.attempt_facts import MAX_ROWS_SEARCHED, BatchInFlight
from qlora_supervise.trainer_child.contract.checkpoints import CHECKPOINT_PREFIX, ResumeSource
from qlora_supervise.trainer_child.contract.codes import Stage
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, Knobs, rank_file
from qlora_supervise.trainer_child.recipe import activations, resume
from qlora_supervise.trainer_child.run import memory, torchrun
from qlora_supervise.trainer_child.run.heartbeat import Progress

# Test hooks, never set elsewhere:
#: ``SECONDS`` or ``SECONDS@STEP``: sleep mid-write of every checkpoint (after the adapter, before the
#: optimizer state), or only from step STEP on, so a test can SIGKILL the child mid-write.
TEST_PAUSE_IN_SAVE = "QLORA_SUPERVISE_TEST_PAUSE_IN_SAVE"
#: A file each micro-batch's row fingerprints, input_ids and labels are appended to (rank N: its
#: own ``rank_file``), so a test can check which samples a resumed run sees and what the loss covers.
TEST_TRACE_BATCHES = "QLORA_SUPERVISE_TEST_TRACE_BATCHES"
#: ``BYTES`` leaked on the training device in each optimizer step's first forward: memory creep.
TEST_LEAK_PER_STEP = "QLORA_SUPERVISE_TEST_LEAK_PER_STEP"

KEEP_CHECKPOINTS = 3
#: Leading tokens kept of each row of the micro-batch in flight, to find it in the training set.
ROW_KEY_TOKENS = 32


@dataclass(frozen=True)
class CheckpointPlan:
    directory: Path
    knobs: Knobs
    protect: Path | None


# A Trainer to the type checker, a plain mixin at run time: it goes in front of any Trainer subclass
# (ours below, or a foreign tool's: trainer_child/shim/attach.py).
if TYPE_CHECKING:
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class SupervisedTrainerMixin(_TrainerBase):
    """Any Trainer, reporting stage and step to :class:`Progress`, with our atomic checkpoints and the
    emergency save; :meth:`supervise` sets it up, and adds our callback, after the Trainer's own init."""

    def supervise(self, progress: Progress, spec: AttemptSpec, source: ResumeSource) -> None:
        self.progress = progress
        protect = Path(spec.resume_from) if spec.resume_from else None  # the checkpoint resumed from
        self.plan = CheckpointPlan(Path(spec.checkpoints_dir), spec.knobs, protect)
        self.place = torchrun.this_rank()
        self._staging_root: Path | None = None
        self._step_loss: torch.Tensor | None = None
        self._emergency, self._step_tokens, self._step_started = False, 0, time.monotonic()
        self.shapes = memory.StepShapes()  # for the OOM handler: did a step of this shape fit already?
        # For the OOM report, the micro-batch in flight: step, index in it, lengths, leading tokens.
        self._batch: tuple[int, int, tuple[int, ...], list[list[int]]] | None = None
        self._leaked: list[torch.Tensor] = []  # TEST_LEAK_PER_STEP only
        backward = self.accelerator.backward

        def tracked_backward(loss: torch.Tensor, **kw: Any) -> None:
            progress.enter(Stage.BACKWARD)
            backward(loss, **kw)

        self.accelerator.backward = tracked_backward
        self.add_callback(SupervisionCallback(self, source, spec.cpu_memory_limit))

    def compute_loss(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> Any:
        if model.training:
            self.progress.enter(Stage.FORWARD)
            # The step's first micro-batch only (the test's variable is read there); ones: pages held.
            if self._step_loss is None and (leak := os.environ.get(TEST_LEAK_PER_STEP, "")).isdigit():
                self._leaked.append(torch.ones(int(leak), dtype=torch.uint8, device=self.args.device))
        return super().compute_loss(model, inputs, *args, **kwargs)

    def training_step(self, model: Any, inputs: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        self._trace_batch(inputs)
        self._start_batch(inputs)
        with activations.activation_context(self.plan.knobs):  # forward and backward: activation offload
            loss: torch.Tensor = super().training_step(model, inputs, *args, **kwargs)
        self._step_loss = loss if self._step_loss is None else self._step_loss + loss
        return loss

    def _start_batch(self, inputs: Any) -> None:
        step, ids, mask = self.state.global_step + 1, inputs["input_ids"], inputs.get("attention_mask")
        micro = self._batch[1] + 1 if self._batch is not None and self._batch[0] == step else 0
        rows = [row[m.bool()] for row, m in zip(ids, mask, strict=True)] if mask is not None else list(ids)
        lengths = tuple(int(row.numel()) for row in rows)
        self._step_tokens += sum(lengths)
        self.shapes.micro_batch(tuple(ids.shape))
        self._batch = (step, micro, lengths, [row[:ROW_KEY_TOKENS].tolist() for row in rows])

    def batch_in_flight(self) -> BatchInFlight | None:
        if self._batch is None:
            return None
        step, micro, lengths, keys = self._batch
        return BatchInFlight(step, micro, lengths, find_rows(self.train_dataset, lengths, keys))

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        with self._in_stage(Stage.EVAL):
            return super().evaluate(*args, **kwargs)

    @contextlib.contextmanager
    def _in_stage(self, stage: Stage) -> Iterator[None]:
        before = self.progress.stage
        self.progress.enter(stage)
        yield  # an exception leaves the stage set, for the error report
        self.progress.enter(before)

    def finish_step(self) -> None:
        """After optimizer step N: publish step, loss and throughput, and beat once."""
        now = time.monotonic()
        progress = self.progress
        progress.step = self.state.global_step
        if self._step_loss is not None:
            progress.loss = float(self._step_loss)
        progress.tokens_per_s = self._step_tokens / max(now - self._step_started, 1e-9)
        self._step_loss, self._step_tokens, self._step_started = None, 0, now
        on_cuda = torch.cuda.is_available()
        self.shapes.step_done(progress.step, torch.cuda.max_memory_allocated() if on_cuda else None)
        progress.heartbeat()

    def _trace_batch(self, inputs: Any) -> None:
        if not (trace := os.environ.get(TEST_TRACE_BATCHES)):
            return
        ids = inputs["input_ids"].tolist()
        record = {
            "step": self.state.global_step + 1,
            "rows": [" ".join(map(str, row[:6])) for row in ids],
            "input_ids": ids,
            "rank": self.place.rank,
            "world_size": self.place.world_size,
        }
        if "labels" in inputs:
            record["labels"] = inputs["labels"].tolist()
        with open(rank_file(trace, self.place.rank), "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")

    def _get_output_dir(self, trial: Any) -> str:  # into our staging dir while saving
        return str(self._staging_root or super()._get_output_dir(trial))

    def _save_checkpoint(self, model: Any, trial: Any) -> None:
        with self._in_stage(Stage.SAVE):
            self._write_checkpoint(model, trial)

    def _write_checkpoint(self, model: Any, trial: Any) -> Path:
        # Under torchrun every rank writes into one staging directory (rank N its rng_state_N.pth);
        # rank 0 publishes it once all have written, the others wait: none runs ahead of a half-made one.
        step = self.state.global_step
        final = self.plan.directory / f"{CHECKPOINT_PREFIX}{step}"
        if checkpoints.is_complete(final):
            return final  # e.g. an emergency save right after the regular save of the same step
        main = self.place.is_main
        if main:  # no room for one more like the last: disk_full now, not half-way through
            disk_space.ensure_room(self.plan.directory)
        staging = checkpoints.staging_dir(self.plan.directory, step, torchrun.staging_owner(self.place))
        self._staging_root = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_root = None
        torchrun.barrier(self.place)
        if main:
            written = staging / final.name
            checkpoints.publish(written, final, step=step, knobs=self.plan.knobs, emergency=self._emergency)
            shutil.rmtree(staging, ignore_errors=True)
            checkpoints.rotate(self.plan.directory, KEEP_CHECKPOINTS, self.plan.protect)
            self.progress.events.emit(
                "checkpoint_saved",
                step=step,
                path=str(final),
                emergency=self._emergency,
                early=self.progress.early_checkpoints,
            )
        torchrun.barrier(self.place)
        return final

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        seconds, _, from_step = os.environ.get(TEST_PAUSE_IN_SAVE, "").partition("@")
        too_early = from_step and self.state.global_step < int(from_step)
        pause = float(seconds) if seconds and not too_early else 0.0
        if pause > 0:
            beat = events.Heartbeat(Stage.SAVE, self.progress.step)
            self.progress.events.emit("heartbeat", **beat.fields(), test_pause_in_save=pause)
            time.sleep(pause)
        super()._save_optimizer_and_scheduler(output_dir)

    # Loading the resume checkpoint: a failure is the checkpoint's (truncated, corrupt), not the config's;
    # an OOM in the stage ``resume`` is the resume's (its own ladder), not the load's.
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        with self._in_stage(Stage.RESUME), resume.checkpoint_load(resume_from_checkpoint, "adapter"):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        with self._in_stage(Stage.RESUME), resume.checkpoint_load(checkpoint, "optimizer/scheduler state"):
            resume.inject_resume_cap(checkpoint)
            if not resume.load_through_host(self, self.plan.knobs.optimizer_state_on_host, checkpoint):
                super()._load_optimizer_and_scheduler(checkpoint)

    def _load_scaler(self, checkpoint: str | None) -> None:
        with resume.checkpoint_load(checkpoint, "grad scaler state"):
            super()._load_scaler(checkpoint)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        with resume.checkpoint_load(checkpoint, "RNG state"):
            super()._load_rng_state(checkpoint)

    def drop_step_in_flight(self) -> None:
        """The partly accumulated gradients of step N+1 go; weights and optimizer state are step N's."""
        if self.model is not None:  # Trainer always has one by now; the attribute is Optional
            self.model.zero_grad(set_to_none=True)
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        self._step_loss = None
        memory.free_memory()
        self.progress.stage = Stage.SAVE

    def save_emergency_checkpoint(self) -> Path | None:
        """Checkpoint step N after a failure in forward/backward/eval: its weights and optimizer state are
        exact (step N+1's optimizer.step never ran); only the partly accumulated gradients are dropped."""
        if self.state.global_step <= 0:
            return None  # nothing learnt yet: a fresh start loses nothing
        self.drop_step_in_flight()
        self._emergency = True
        return self._write_checkpoint(self.model, None)

    def save_rank_part(self) -> Path | None:
        """Under torchrun (DDP), this rank's part of step N's emergency checkpoint, with no collective
        (the others are dead or stuck in the one the failure broke; :mod:`...contract.checkpoints`):
        rank 0 the adapter, optimizer, scheduler and state, each rank its RNG state, then the marker."""
        step, place, directory = self.state.global_step, self.place, self.plan.directory
        if step <= 0 or checkpoints.is_complete(directory / f"{CHECKPOINT_PREFIX}{step}"):
            return None  # nothing learnt yet, or step N's regular checkpoint is already sealed
        self.drop_step_in_flight()
        part = checkpoints.part_dir(directory, step, torchrun.staging_owner(place), place.rank)
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        if place.is_main:
            disk_space.ensure_room(directory)
            self._save(str(part))  # what the Trainer's own checkpoint writes of the model
            self._save_optimizer_and_scheduler(str(part))
            self.state.save_to_json(str(part / "trainer_state.json"))
        self._save_rng_state(str(part))
        checkpoints.seal(part)  # the files on disk before the marker that vouches for them
        done = {"step": step, "rank": place.rank, "world_size": place.world_size}
        durable.write_text_atomic(part / checkpoints.PART_DONE, json.dumps(done))
        return part


class SupervisedSFTTrainer(SupervisedTrainerMixin, SFTTrainer):
    def __init__(
        self, *args: Any, progress: Progress, spec: AttemptSpec, source: ResumeSource, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.supervise(progress, spec, source)


class SupervisionCallback(TrainerCallback):
    """Optimizer stage, per-step heartbeat, resume bookkeeping and the graceful stop."""

    def __init__(self, trainer: SupervisedTrainerMixin, source: ResumeSource, cpu_cap: int | None) -> None:
        self.trainer, self.source, self.cpu_cap = trainer, source, cpu_cap
        self.cap_after_step = memory.late_cap_step()
        self.yield_gpu = memory.gpu_yield()

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.progress.step = state.global_step
        source, scheduler = self.source, self.trainer.lr_scheduler
        if source.original is not None:
            if source.reset_from is not None:
                resume.restore_scheduler(self.trainer, Path(source.reset_from))
            resume.follow_schedule(self.trainer, state.global_step)
            self.trainer.progress.events.emit(
                "resumed",
                from_step=state.global_step,
                path=source.original,
                reset_optimizer=source.reset_from is not None,
                reset_reason=source.reset_reason,
                learning_rate=scheduler.get_last_lr()[0] if scheduler is not None else None,
                micro_batch_size=args.per_device_train_batch_size,
                grad_accum=args.gradient_accumulation_steps,
                **(source.rank_reduction.fields() if source.rank_reduction is not None else {}),
            )

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.progress.enter(Stage.OPTIMIZER)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.trainer.finish_step()
        if self.cap_after_step is not None and state.global_step >= self.cap_after_step:
            memory.apply_cpu_cap(self.cpu_cap)  # injected: memory.TEST_CAP_AFTER_STEP
            memory.apply_gpu_cap(torchrun.injected_cap(torchrun.TEST_RANK_GPU_CAP, self.trainer.place))
            self.cap_after_step = None
        if self.yield_gpu is not None and state.global_step == self.yield_gpu[0]:
            memory.free_memory()  # injected: memory.TEST_YIELD_GPU_AT_STEP
            time.sleep(self.yield_gpu[1])
        progress = self.trainer.progress
        stop, early = torchrun.decide_together(self.trainer.place, progress, args.device)
        if early:  # memory creeps towards the budget: lose no step to it
            progress.announce_early_checkpoints()
            control.should_save = True
        if stop:
            progress.announce_stop()
            control.should_save = True  # SIGTERM: finish this step, checkpoint, leave
            control.should_training_stop = True


def find_rows(dataset: Any, lengths: tuple[int, ...], keys: list[list[int]]) -> tuple[int, ...] | None:
    """The indices of the rows with these lengths and leading tokens (-1: not found); None when the
    set cannot be searched (no ``input_ids`` column, packed, or above MAX_ROWS_SEARCHED rows)."""
    names = getattr(dataset, "column_names", None) or []
    if "input_ids" not in names or len(dataset) > MAX_ROWS_SEARCHED:
        return None
    wanted = {(length, tuple(key)): at for at, (length, key) in enumerate(zip(lengths, keys, strict=True))}
    found = [-1] * len(lengths)
    for index, row in enumerate(dataset["input_ids"]):
        position = wanted.get((len(row), tuple(row[:ROW_KEY_TOKENS])))
        if position is not None and found[position] < 0:
            found[position] = index
    return tuple(found)
