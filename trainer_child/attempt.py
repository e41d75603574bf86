"""One training attempt: setup → recipe → train → adapter, and the failure path.

Exit codes (protocol.ExitCode): OK after the adapter is saved; STOPPED after SIGTERM and a
checkpoint; OOM / CONFIG / FAILED after the error report. The failure path runs *outside*
the ``except`` block so that the exception, its traceback and the activations its frames
hold are gone before the emergency checkpoint needs memory.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from . import checkpoints
from .allocator_facts import AllocatorFacts
from .checkpoint_dirs import newest_complete_checkpoint
from .durable import fsync_dir
from .events import LOOP_STAGES, EventLog, HeartbeatThread, Progress
from .failure import CapturedFailure, ConfigError, capture, write_report
from .protocol import (
    EARLY_CHECKPOINT_SIGNAL,
    MEMORY_SNAPSHOT_NAME,
    AttemptSpec,
    ExitCode,
    Stage,
    failure_line,
)
from .stack import import_training_stack

#: Stages where the optimizer has not touched the weights of the step in flight, so the state
#: is exactly that of the last completed step. An optimizer-stage OOM may leave the step
#: half-applied (some parameters updated, others not): no emergency checkpoint then.
EMERGENCY_STAGES = (Stage.FORWARD, Stage.BACKWARD, Stage.EVAL)


class Context:
    """What the failure path needs, filled in as setup gets further."""

    def __init__(self, spec: AttemptSpec) -> None:
        self.spec = spec
        self.events = EventLog(spec.events_file)
        self.progress = Progress(self.events)
        self.on_cuda = False
        self.expandable: bool | None = None
        self.trainer: Any = None
        self.heartbeat: HeartbeatThread | None = None
        self.memory_history = False  # diagnose.memory_history is recording

    @property
    def device(self) -> str:
        return "cuda" if self.on_cuda else "cpu"


def install_stop_handler(progress: Progress) -> None:
    """SIGTERM only sets a flag: the step in flight finishes, then we checkpoint and leave.
    The early-checkpoint signal (memory creep) only sets one too: checkpoint after each step."""

    def on_term(signum: int, frame: FrameType | None) -> None:
        progress.stop_requested = True

    def on_early_checkpoint(signum: int, frame: FrameType | None) -> None:
        progress.early_checkpoints = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(EARLY_CHECKPOINT_SIGNAL, on_early_checkpoint)


def setup(ctx: Context) -> None:
    """Heavy imports, caps, ``started``; the CPU cap after the imports (see apply_cpu_cap)."""
    import torch

    from . import memory

    ctx.on_cuda = torch.cuda.is_available()
    memory.apply_gpu_cap(ctx.spec.gpu_memory_limit)
    ctx.memory_history = memory.start_memory_history(ctx.spec.diagnose)
    ctx.expandable = memory.expandable_segments_active()
    versions = import_training_stack()
    vmdata = memory.proc_status_bytes("VmData")
    ctx.events.emit(
        "started",
        pid=os.getpid(),
        attempt=ctx.spec.attempt,
        device=ctx.device,
        device_name=torch.cuda.get_device_name(0) if ctx.on_cuda else "cpu",
        versions=versions,
        vmdata=vmdata,
        rss=memory.proc_status_bytes("VmRSS"),
        cpu_memory_limit=ctx.spec.cpu_memory_limit,
        gpu_memory_limit=ctx.spec.gpu_memory_limit,
        expandable_segments_active=ctx.expandable,
    )
    if memory.late_cap_step() is None:
        memory.apply_cpu_cap(ctx.spec.cpu_memory_limit)


def resume_source(spec: AttemptSpec) -> tuple[str | None, str | None]:
    """(checkpoint to resume from, same when the optimizer is reset else None).

    ``resume_from="auto"`` (for runs by hand) takes the newest complete checkpoint, if any.
    """
    checkpoints_dir = Path(spec.checkpoints_dir)
    checkpoints.remove_stale_temps(checkpoints_dir)
    source: Path | None = Path(spec.resume_from) if spec.resume_from else None
    if spec.resume_from == "auto":
        newest = newest_complete_checkpoint(checkpoints_dir)
        source = newest[1] if newest else None
    if source is None:
        return None, None
    if not checkpoints.is_complete(source):
        raise ConfigError(f"resume_from {source}: not a complete checkpoint (no completion marker)")
    if not spec.reset_optimizer:
        return str(source), None
    stripped = checkpoints.without_optimizer(source, checkpoints_dir / f".tmp-reset-{os.getpid()}")
    return str(stripped), str(stripped)


def save_adapter(trainer: Any, tokenizer: Any, adapter_dir: Path) -> None:
    """Final adapter, atomically: temp dir + rename (an old adapter is replaced whole)."""
    temp = adapter_dir.with_name(f".tmp-{adapter_dir.name}-{os.getpid()}")
    shutil.rmtree(temp, ignore_errors=True)
    trainer.model.save_pretrained(temp)
    tokenizer.save_pretrained(temp)
    checkpoints.fsync_tree(temp)
    if adapter_dir.exists():
        old = adapter_dir.with_name(f".old-{adapter_dir.name}-{os.getpid()}")
        os.rename(adapter_dir, old)
        shutil.rmtree(old, ignore_errors=True)
    os.rename(temp, adapter_dir)
    fsync_dir(adapter_dir.parent)


def train(ctx: Context) -> ExitCode:
    from .recipe import build

    spec = ctx.spec
    resume_from, reset_from = resume_source(spec)
    recipe = build(spec, ctx.progress, ctx.on_cuda, resume_from, reset_from)
    ctx.trainer = recipe.trainer
    if ctx.progress.stop_requested:  # SIGTERM during the load: nothing new to save
        ctx.progress.announce_stop()
        return ExitCode.STOPPED
    recipe.trainer.train(resume_from_checkpoint=resume_from)
    if reset_from is not None:  # the optimizer-less copy has served its purpose
        shutil.rmtree(Path(reset_from).parent, ignore_errors=True)
    if ctx.progress.stop_requested:
        return ExitCode.STOPPED
    ctx.progress.enter(Stage.SAVE)
    save_adapter(recipe.trainer, recipe.tokenizer, Path(spec.adapter_dir))
    ctx.events.emit("finished", step=recipe.trainer.state.global_step, adapter=spec.adapter_dir)
    return ExitCode.OK


def fail(ctx: Context, failure: CapturedFailure) -> ExitCode:
    """Emergency checkpoint when the state is consistent, then the report (cheaply)."""
    from . import memory

    emergency = None
    if failure.oom and ctx.trainer is not None and failure.stage in EMERGENCY_STAGES:
        try:
            path = ctx.trainer.save_emergency_checkpoint()
            emergency = (str(path), ctx.trainer.state.global_step) if path else None
        except BaseException as exc:  # the report must still be written
            failure.traceback += f"\nemergency checkpoint failed: {type(exc).__name__}: {exc}\n"
    ctx.trainer = None
    memory.free_memory()
    memory.lift_cpu_cap()  # the cap is ours (soft limit): the report must not hit it
    write_report(
        ctx.spec.error_file,
        failure,
        device=ctx.device,
        memory_stats=memory.cuda_memory_stats() if ctx.on_cuda else None,
        emergency=emergency,
        expandable_segments_active=ctx.expandable,
    )
    print(
        failure_line(failure.stage.value, failure.exception_type, failure.message[:2000]),
        file=sys.stderr,
        flush=True,
    )
    return failure.exit_code


def guarded(spec: AttemptSpec, body: Callable[[Context], ExitCode]) -> int:
    """Run ``body`` with heartbeats; any exception becomes a report and a reserved exit code."""
    ctx = Context(spec)
    install_stop_handler(ctx.progress)
    failure: CapturedFailure | None = None
    try:
        setup(ctx)
        ctx.heartbeat = HeartbeatThread(ctx.progress, spec.heartbeat_interval)
        ctx.heartbeat.start()
        code = body(ctx)
    except BaseException as exc:  # every failure must leave a report
        at_oom = oom_diagnosis(ctx, exc)  # while the frames still hold the step's tensors
        failure = capture(exc, ctx.progress.stage, ctx.progress.step)
        failure.allocator, failure.memory_snapshot = at_oom
        del exc
    if failure is not None:
        code = fail(ctx, failure)
    if ctx.heartbeat is not None:
        ctx.heartbeat.stop()
    ctx.events.close()
    return int(code)


def oom_diagnosis(ctx: Context, exc: BaseException) -> tuple[AllocatorFacts | None, str | None]:
    """The allocator's facts and, when recorded, its snapshot, for an OOM on the GPU."""
    if not ctx.on_cuda:
        return None, None
    from . import memory

    try:
        # A step of the same shape proves a *training* step fits: not an eval or a save.
        training = ctx.progress.stage in LOOP_STAGES
        shapes = getattr(ctx.trainer, "shapes", None) if training else None
        facts = memory.allocator_facts_at_oom(exc, ctx.spec.gpu_memory_limit, shapes)
        snapshot = None
        if facts is not None and ctx.memory_history:
            snapshot = memory.dump_memory_snapshot(Path(ctx.spec.error_file).parent / MEMORY_SNAPSHOT_NAME)
    except Exception:  # diagnosis is a bonus: the report must still be written
        return None, None
    return facts, snapshot


def run(spec: AttemptSpec) -> int:
    return guarded(spec, train)
