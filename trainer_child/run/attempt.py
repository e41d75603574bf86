"""One training attempt: setup → recipe → train → adapter, and the failure path. Exit code: OK after the
adapter is saved, STOPPED after SIGTERM and a checkpoint, else the failure's after the error report. The
failure path runs outside ``except``: the frames' activations are gone before the emergency checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from qlora_supervise.trainer_child.contract import checkpoints, disk_space, durable, events, oom_message
from qlora_supervise.trainer_child.contract.attempt_facts import BatchInFlight
from qlora_supervise.trainer_child.contract.codes import ExitCode, Stage
from qlora_supervise.trainer_child.contract.report import ErrorReport, failure_line
from qlora_supervise.trainer_child.contract.spec import (
    EARLY_CHECKPOINT_SIGNAL,
    MEMORY_SNAPSHOT_NAME,
    AttemptSpec,
)
from qlora_supervise.trainer_child.recipe.data import Prepared
from qlora_supervise.trainer_child.recipe.stack import import_training_stack
from qlora_supervise.trainer_child.run import memory, torchrun
from qlora_supervise.trainer_child.run.failure import CapturedFailure, ConfigError, capture, oom_numbers
from qlora_supervise.trainer_child.run.heartbeat import LOOP_STAGES, EventLog, HeartbeatThread, Progress
from qlora_supervise.trainer_child.run.torchrun import SINGLE, RankPlace, staging_owner, this_rank

#: Stages where the state is exactly the last completed step's (not the optimizer's: half-applied).
EMERGENCY_STAGES = (Stage.FORWARD, Stage.BACKWARD, Stage.EVAL)
TRUST_REMOTE_CODE_WARNING = (
    "trainer child: warning: trust_remote_code is on: Python code from the model directory runs "
    "in this process"
)


class Context:
    """What the failure path needs, filled in as setup gets further."""

    def __init__(self, spec: AttemptSpec, prepared: Prepared | None = None) -> None:
        self.spec = spec
        self.events = EventLog(spec.events_file)
        self.progress = Progress(self.events)
        self.on_cuda = False
        self.expandable: bool | None = None
        self.trainer: Any = None
        self.heartbeat: HeartbeatThread | None = None
        self.resume_checkpoint: str | None = None  # the source checkpoint, once chosen
        self.memory_history = False  # diagnose.memory_history is recording
        self.place = this_rank()  # rank 0 of 1 outside torchrun
        self.prepared = prepared  # a warm spare's tokenizer and rows (see recipe.data.Prepared)


def install_stop_handler(progress: Progress) -> None:
    """SIGTERM and the early-checkpoint signal set flags: the step ends, then a checkpoint (SIGTERM: exit)."""
    signal.signal(signal.SIGTERM, lambda signum, frame: setattr(progress, "stop_requested", True))
    signal.signal(EARLY_CHECKPOINT_SIGNAL, lambda signum, frame: setattr(progress, "early_checkpoints", True))


def setup(ctx: Context, versions: Callable[[], dict[str, str]] = import_training_stack) -> None:
    """Device, caps, heavy imports, ``started``; the CPU cap after the imports (see apply_cpu_cap).
    ``versions`` imports the stack and names it (the shim's names what the tool's venv has)."""
    import torch

    ctx.on_cuda = torch.cuda.is_available()
    cpu_fallback = torchrun.check_device(ctx.spec, ctx.on_cuda)  # a GPU asked for and missing: ConfigError
    if ctx.on_cuda:
        torchrun.use_rank_gpu(ctx.place)  # cuda:LOCAL_RANK: every later device-0 default means it
    memory.apply_gpu_cap(ctx.spec.gpu_memory_limit)
    ctx.memory_history = memory.start_memory_history(ctx.spec.diagnose)
    ctx.expandable = memory.expandable_segments_active()
    started = events.Started(
        pid=os.getpid(),
        attempt=ctx.spec.attempt,
        **dataclasses.asdict(ctx.place),  # rank, local_rank, world_size
        device="cuda" if ctx.on_cuda else "cpu",
        device_name=torch.cuda.get_device_name() if ctx.on_cuda else "cpu",
        versions=versions(),
        vmdata=memory.proc_status_bytes("VmData"),
        rss=memory.proc_status_bytes("VmRSS"),
        cpu_memory_limit=ctx.spec.cpu_memory_limit,
        gpu_memory_limit=ctx.spec.gpu_memory_limit,
        expandable_segments_active=ctx.expandable,
        cpu_fallback=cpu_fallback,
        trust_remote_code=ctx.spec.train.trust_remote_code,
    )
    ctx.events.write(started.to_line())
    if ctx.spec.train.trust_remote_code:
        print(TRUST_REMOTE_CODE_WARNING, file=sys.stderr, flush=True)
    if memory.late_cap_step() is None:  # else the trainer caps after that step (a test's fault)
        memory.apply_cpu_cap(ctx.spec.cpu_memory_limit)


def chosen_checkpoint(spec: AttemptSpec) -> Path | None:
    """The checkpoint the spec names (``auto``, for runs by hand: the newest complete one), after
    removing dead writers' staging dirs. A linked ``checkpoints_dir`` is a ConfigError."""
    checkpoints_dir = Path(spec.checkpoints_dir)
    try:
        checkpoints.refuse_linked_dir(checkpoints_dir)
    except checkpoints.UnsafeCheckpointPath as exc:
        raise ConfigError(str(exc)) from exc
    checkpoints.remove_stale_temps(checkpoints_dir)
    if spec.resume_from == "auto":
        newest = checkpoints.newest_complete_checkpoint(checkpoints_dir)
        return newest[1] if newest else None
    return Path(spec.resume_from) if spec.resume_from else None


def resume_choice(ctx: Context) -> checkpoints.ResumeSource:
    """:func:`resume_source` of the chosen checkpoint, named in ``ctx`` first (for the report if it fails)."""
    chosen = chosen_checkpoint(ctx.spec)
    ctx.resume_checkpoint = str(chosen) if chosen is not None else None
    return resume_source(ctx.spec, chosen)


def resume_source(spec: AttemptSpec, source: Path | None) -> checkpoints.ResumeSource:
    """How to resume from ``source``, checked to be loadable (CheckpointLoadError if not). Without
    optimizer state it resumes as a reset; an adapter of a larger rank is cut to ``lora_r`` in an
    optimizer-less scratch copy (:mod:`...recipe.resume`), never in the original."""
    if source is None:
        return checkpoints.ResumeSource()
    if not checkpoints.is_complete(source):
        raise ConfigError(f"resume_from {source}: not a complete checkpoint (no completion marker)")
    checkpoints.check_loadable(source)
    original = str(source)
    from qlora_supervise.trainer_child.recipe.resume import adapter_rank, truncate_adapter  # imports torch

    saved = adapter_rank(source)
    cut = saved is not None and saved > spec.knobs.lora_r
    if not cut and not any((source / name).is_file() for name in checkpoints.OPTIMIZER_FILES):
        why = f"{source.name} holds no optimizer state ({' or '.join(checkpoints.OPTIMIZER_FILES)} missing)"
        return checkpoints.ResumeSource(original, original, why, original)
    if not spec.reset_optimizer and not cut:
        return checkpoints.ResumeSource(original, original=original)
    if saved is not None and saved < spec.knobs.lora_r:  # a rank cannot grow
        raise ConfigError(
            f"resume_from {source}: adapter rank {saved} is smaller than lora_r {spec.knobs.lora_r}; "
            "resume at its rank or start from step 0"
        )
    stripped = checkpoints.without_optimizer(source, Path(spec.checkpoints_dir) / f".tmp-reset-{os.getpid()}")
    why = "fresh optimizer state asked for (the optimizer changed, or its saved state is damaged)"
    reduction = None
    if cut:
        reduction = truncate_adapter(stripped, spec.knobs.lora_r, spec.knobs.lora_alpha)
        why = "the adapter was cut to a smaller rank: the optimizer state's shapes no longer fit"
    return checkpoints.ResumeSource(str(stripped), str(stripped), why, original, reduction)


def save_adapter(
    trainer: Any, tokenizer: Any, adapter_dir: Path, place: RankPlace = SINGLE, sharded: bool = False
) -> None:
    """Final adapter, atomically (temp dir + :func:`checkpoints.replace_dir`). Under DDP rank 0 alone
    calls it; under FSDP every rank does (gathering the shards is a collective), rank 0 writes."""
    temp = adapter_dir.with_name(f".tmp-{adapter_dir.name}-{staging_owner(place)}")
    if place.is_main:
        shutil.rmtree(temp, ignore_errors=True)
    if sharded:
        trainer.save_model(str(temp))
    else:
        trainer.model.save_pretrained(temp)
    if place.is_main:
        tokenizer.save_pretrained(temp)
        checkpoints.replace_dir(temp, adapter_dir)


def train(ctx: Context) -> ExitCode:
    from qlora_supervise.trainer_child.recipe.qlora import build

    spec = ctx.spec
    source = resume_choice(ctx)
    ctx.trainer = trainer = build(spec, ctx.progress, ctx.on_cuda, source, ctx.prepared)
    ctx.prepared = None  # the trainer holds what it took; the rest need not live on
    from qlora_supervise.trainer_child.run import speed_trial

    if speed_trial.wanted(spec, resuming=source.load_from is not None) and not ctx.progress.stop_requested:
        speed_trial.run(trainer, spec, ctx.progress, ctx.on_cuda)  # before step 1 only
    if ctx.progress.stop_requested:  # SIGTERM during the load (or the trial): nothing new to save
        ctx.progress.announce_stop()
        return ExitCode.STOPPED
    trainer.train(resume_from_checkpoint=source.load_from)
    if source.reset_from is not None and source.reset_from != source.original:
        shutil.rmtree(Path(source.reset_from).parent, ignore_errors=True)  # the optimizer-less copy
    if ctx.progress.stop_requested:
        return ExitCode.STOPPED
    ctx.progress.enter(Stage.SAVE)
    if ctx.place.is_main or spec.knobs.fsdp:  # DDP: the ranks hold the same adapter, one saves it
        save_adapter(trainer, trainer.processing_class, Path(spec.adapter_dir), ctx.place, spec.knobs.fsdp)
    ctx.events.emit("finished", step=trainer.state.global_step, adapter=spec.adapter_dir)
    return ExitCode.OK


def fail(ctx: Context, failure: CapturedFailure) -> ExitCode:
    """Emergency checkpoint when the state is consistent, then the report."""
    emergency = None
    try:
        path = emergency_save(ctx, failure)
        emergency = (str(path), ctx.trainer.state.global_step) if path else None
    except BaseException as exc:  # the report must still be written
        failure.traceback += f"\nemergency checkpoint failed: {type(exc).__name__}: {exc}\n"
    ctx.trainer = None
    # After a CUDA OOM a gc and empty_cache only delay the exit the next attempt waits for; after
    # any other (a host OOM under a hard RLIMIT_DATA above all) they make room for the report.
    if not failure.device_oom:
        memory.free_memory()
    memory.lift_cpu_cap()  # the cap is ours (soft limit): the report must not hit it
    report_failure(ctx, failure, emergency)
    line = failure_line(failure.stage.value, failure.exception_type, failure.message[:2000])
    with contextlib.suppress(OSError):  # stderr is child.log, on the run's disk, which may be full
        print(line, file=sys.stderr, flush=True)
    return failure.exit_code


def emergency_save(ctx: Context, failure: CapturedFailure) -> Path | None:
    """The emergency checkpoint a failure in forward, backward or eval allows: one process's after its OOM;
    under DDP each rank's part after any (all hold step N). Not FSDP's: its gather is a broken collective."""
    if ctx.trainer is None or failure.stage not in EMERGENCY_STAGES:
        return None
    if not ctx.place.distributed:
        return ctx.trainer.save_emergency_checkpoint() if failure.oom else None
    return None if ctx.spec.knobs.fsdp else ctx.trainer.save_rank_part()


def report_failure(ctx: Context, failure: CapturedFailure, emergency: tuple[str, int] | None) -> None:
    """Write the error report; on a disk with no room for it, the exit code and stderr must do."""
    report = ErrorReport(
        exit_code=int(failure.exit_code),
        exception_type=failure.exception_type,
        message=failure.message,
        traceback=failure.traceback,
        stage=failure.stage,
        step=failure.step,
        is_oom=failure.oom,
        config_error=failure.config,
        oom_numbers=oom_message.OomNumbers.from_json(oom_numbers(failure.message) if failure.oom else {}),
        memory_stats=memory.cuda_memory_stats() if ctx.on_cuda else None,
        device="cuda" if ctx.on_cuda else "cpu",
        emergency_checkpoint=emergency[0] if emergency else None,
        emergency_step=emergency[1] if emergency else None,
        expandable_segments_active=ctx.expandable,
        damaged_checkpoint=ctx.resume_checkpoint if failure.exit_code is ExitCode.CHECKPOINT else None,
        disk_full=failure.disk_full,
        disk=disk_space.disk_facts(ctx.spec.checkpoints_dir) if failure.disk_full else None,
        allocator=failure.allocator,
        memory_snapshot=failure.memory_snapshot,
        batch=failure.batch,
        time=failure.time,
        **dataclasses.asdict(ctx.place),  # rank, local_rank, world_size
    )
    try:
        durable.write_text_atomic(ctx.spec.error_file, report.to_json())
    except OSError as exc:
        if not disk_space.is_disk_full(exc):
            raise
        failure.disk_full = True  # the report itself found the disk full: exit DISK_FULL, say why
        failure.message += f" (and the error report could not be written: {exc})"


def guarded(spec: AttemptSpec, body: Callable[[Context], ExitCode], prepared: Prepared | None = None) -> int:
    """Run ``body`` with heartbeats; any exception becomes a report and a reserved exit code."""
    ctx = Context(spec, prepared)
    install_stop_handler(ctx.progress)
    failure: CapturedFailure | None = None
    try:
        setup(ctx)
        ctx.heartbeat = HeartbeatThread(ctx.progress, spec.heartbeat_interval)
        ctx.heartbeat.start()
        code = body(ctx)
    except BaseException as exc:  # every failure must leave a report
        failure = captured(ctx, exc)
        del exc
    if failure is not None:
        code = fail(ctx, failure)
    if ctx.heartbeat is not None:
        ctx.heartbeat.stop()
    ctx.events.close()
    return int(code)


def captured(ctx: Context, exc: BaseException) -> CapturedFailure:
    """``exc`` reduced to strings, with the allocator's facts and snapshot of a GPU OOM, read first (the
    frames still hold the step's tensors), and the micro-batch a training step's OOM happened on."""
    facts, snapshot = None, None
    if ctx.on_cuda:
        try:
            # A step of the same shape proves a *training* step fits: not an eval or a save.
            shapes = getattr(ctx.trainer, "shapes", None) if ctx.progress.stage in LOOP_STAGES else None
            facts = memory.allocator_facts_at_oom(exc, ctx.spec.gpu_memory_limit, shapes)
            if facts is not None and ctx.memory_history:
                snapshot = memory.dump_memory_snapshot(
                    Path(ctx.spec.error_file).parent / MEMORY_SNAPSHOT_NAME
                )
        except Exception:  # diagnosis is a bonus: the report must still be written
            facts, snapshot = None, None
    failure = capture(exc, ctx.progress.stage, ctx.progress.step)
    failure.allocator, failure.memory_snapshot = facts, snapshot
    if failure.oom and failure.stage in LOOP_STAGES and ctx.trainer is not None:
        with contextlib.suppress(Exception):  # a bonus, as the allocator's facts: the report comes first
            batch = ctx.trainer.batch_in_flight()
            failure.batch = batch if isinstance(batch, BatchInFlight) else None
    return failure


def run(spec: AttemptSpec, prepared: Prepared | None = None) -> int:
    return guarded(spec, train, prepared)
