"""One supervised attempt inside a foreign tool: our child's heartbeats, checkpoints, emergency save, error
report and speed trial, from the same code. At ``Trainer.train`` the instance's class becomes a subclass of
its own with our mixin in front, our callback is added, and ``resume_from_checkpoint`` is the supervisor's
choice; a failure before it goes to ``sys.excepthook``. A trial that cannot time the tool's batches
(:func:`cannot_time`, no tokenized row, a batch its loss or collator refuses) keeps the plan, saying why."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import sys
from importlib import metadata
from pathlib import Path
from types import SimpleNamespace, TracebackType
from typing import Any, NoReturn

from qlora_supervise.trainer_child.contract.codes import ExitCode, Stage
from qlora_supervise.trainer_child.contract.processes import exit_now
from qlora_supervise.trainer_child.contract.script_knobs import as_built
from qlora_supervise.trainer_child.contract.spec import AttemptSpec
from qlora_supervise.trainer_child.run import attempt, speed_trial
from qlora_supervise.trainer_child.run.failure import CapturedFailure
from qlora_supervise.trainer_child.run.heartbeat import HeartbeatThread
from qlora_supervise.trainer_child.shim.script import Ledger

#: Libraries whose versions the ``started`` event names (those installed: a foreign venv may lack some).
VERSIONED = ("torch", "transformers", "peft", "trl", "accelerate", "bitsandbytes", "axolotl", "llamafactory")
_NO_TOKENIZER = SimpleNamespace(save_pretrained=lambda directory: None)


@functools.cache
def supervised_class(cls: type) -> type:
    """``cls`` with :class:`SupervisedTrainerMixin` in front, made once per class."""
    from qlora_supervise.trainer_child.recipe.trainer import SupervisedTrainerMixin

    if issubclass(cls, SupervisedTrainerMixin):
        return cls
    return type(f"Supervised{cls.__name__}", (SupervisedTrainerMixin, cls), {})


class Session:
    """The attempt, from ``transformers.trainer``'s import to the process's exit."""

    def __init__(self, spec: AttemptSpec, ledger: Ledger | None = None) -> None:
        self.ctx = ctx = attempt.Context(spec)
        self.trialled = False
        self.ledger = ledger  # a script's: the knobs it built, reported once
        attempt.install_stop_handler(ctx.progress)
        self._previous_hook = sys.excepthook
        sys.excepthook = self._uncaught
        attempt.setup(ctx, installed_versions)
        ctx.events.emit("shim_attached", trainer_module="transformers.trainer", command=list(spec.command))
        ctx.heartbeat = HeartbeatThread(ctx.progress, spec.heartbeat_interval)
        ctx.heartbeat.start()
        ctx.progress.enter(Stage.LOAD)  # the tool loads its model and data next

    def patch(self, trainer_class: Any) -> None:
        """Wrap ``trainer_class.train`` (transformers' ``Trainer``) so every subclass goes through us."""
        original = trainer_class.train

        @functools.wraps(original)
        def train(trainer: Any, *args: Any, **kwargs: Any) -> Any:
            return self.train(trainer, original, args, kwargs)

        trainer_class.train = train

    def train(self, trainer: Any, original: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """The tool's ``trainer.train(...)``, supervised; a failure ends the process with our exit code."""
        ctx = self.ctx
        self._stop_if_asked()  # SIGTERM during the tool's load: nothing new to save
        failure: CapturedFailure | None = None
        result: Any = None
        try:
            self._report_knobs(trainer)
            source = attempt.resume_choice(ctx)  # checked as our child checks it
            if ctx.trainer is not trainer:  # else a second train() on this Trainer: attached already
                trainer.__class__ = supervised_class(trainer.__class__)  # our mixin, then our callback
                trainer.supervise(ctx.progress, ctx.spec, source)
                ctx.trainer = trainer
            self._speed_trial(trainer, resuming=source.load_from is not None)
            self._stop_if_asked()
            # The supervisor's choice (perhaps an optimizer-less copy the tool cannot know); a tool's own,
            # Trainer.train's first positional parameter, would override it, so it goes.
            kwargs["resume_from_checkpoint"] = source.load_from
            result = original(trainer, *args[1:], **kwargs) if args else original(trainer, **kwargs)
        except BaseException as exc:  # every failure must leave a report
            failure = attempt.captured(ctx, exc)
        if failure is not None:
            self.leave(attempt.fail(ctx, failure))
        self._stop_if_asked()  # the callback checkpointed and stopped training
        ctx.progress.enter(Stage.SAVE)  # training ended: the adapter where ours goes, and ``finished``
        if ctx.place.is_main:  # a Trainer without a tokenizer saves the adapter alone
            adapter_dir = Path(ctx.spec.adapter_dir)
            attempt.save_adapter(trainer, trainer.processing_class or _NO_TOKENIZER, adapter_dir)
        ctx.events.emit("finished", step=trainer.state.global_step, adapter=ctx.spec.adapter_dir)
        ctx.trainer = None
        return result

    def _stop_if_asked(self) -> None:
        if self.ctx.progress.stop_requested:
            self.ctx.progress.announce_stop()
            self.leave(ExitCode.STOPPED)

    def _report_knobs(self, trainer: Any | None) -> None:
        """A script's knobs as its Trainer will train with them, reported once."""
        ledger, self.ledger = self.ledger, None
        if ledger is None:
            return
        if trainer is not None:
            ledger.check(trainer)
        ledger.report(self.ctx.events, trainer)
        # The checkpoints' and the resume's knobs are what the script built.
        spec = self.ctx.spec
        self.ctx.spec = dataclasses.replace(spec, knobs=as_built(spec.knobs, ledger.settings))

    def _speed_trial(self, trainer: Any, resuming: bool) -> None:
        """Our child's trial on the tool's Trainer, once, before step 1; or the plan kept, saying why."""
        ctx = self.ctx
        if self.trialled or ctx.progress.stop_requested or not speed_trial.wanted(ctx.spec, resuming):
            return
        self.trialled = True  # a second train() on the same process trains as the first chose
        began = speed_trial.Began.now(ctx.progress, trainer)
        why, results = cannot_time(trainer), None
        if why is None:
            try:
                row = tool_row(trainer)
            except Exception as exc:  # not a dataset the trial can read: the plan stays
                why = f"no tokenized training row to time ({_said(exc)})"
        if why is None:
            try:  # the timing alone: the policy's choice, applied after it, is our own code
                results = speed_trial.time_all(trainer, ctx.spec, ctx.on_cuda, row)
            except Exception as exc:  # the tool's loss or collator on the trial's batch
                why = f"the tool's Trainer did not take the trial's batch ({_said(exc)})"
            gc.collect()  # a traceback's frames held the failed micro-step's tensors
        if results is not None:
            speed_trial.conclude(trainer, ctx.progress, ctx.on_cuda, results, began)
        else:
            speed_trial.abandon(trainer, ctx.progress, ctx.on_cuda, why or "nothing to time", began)

    def _uncaught(self, kind: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
        """An exception outside ``train`` (the tool's model or data load): our report and exit code."""
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            self._previous_hook(kind, exc, tb)
            return
        self._report_knobs(None)  # what the script built before it failed
        failure = attempt.captured(self.ctx, exc)
        del exc, tb
        self.leave(attempt.fail(self.ctx, failure))

    def leave(self, code: int) -> NoReturn:
        """End the process now: the tool's code after ``train`` must not save or push a failed model."""
        if self.ctx.heartbeat is not None:
            self.ctx.heartbeat.stop()
        self.ctx.events.close()
        exit_now(int(code))  # the report and the checkpoint are on disk, fsynced


def installed_versions() -> dict[str, str]:
    """The versions of :data:`VERSIONED` that are installed here."""
    found = {}
    for name in VERSIONED:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def cannot_time(trainer: Any) -> str | None:
    """Why the trial cannot time this Trainer's batches, or None."""
    args = trainer.args
    if getattr(args, "sample_packing", False):
        return "axolotl's sample_packing: its batches are packed per micro-batch"
    names = ("activation_offloading", "layer_offloading")
    if offloads := ", ".join(name for name in names if getattr(args, name, False)):
        return f"the tool offloads in its own training step ({offloads}): the trial would measure without it"
    return "the Trainer has no train_dataset" if getattr(trainer, "train_dataset", None) is None else None


def tool_row(trainer: Any) -> dict[str, Any]:
    """The longest training row, with the columns the Trainer's own dataloader keeps (as it finds them)."""
    row = speed_trial.longest_row(trainer.train_dataset)
    find = getattr(trainer, "_set_signature_columns_if_needed", None)
    if not getattr(trainer.args, "remove_unused_columns", False) or find is None:
        return row
    find()
    kept = getattr(trainer, "_signature_columns", None)
    return {k: v for k, v in row.items() if k in kept} if kept else row


def _said(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:200]}"
