"""Failure classification inside the child: OOM recognition, the numbers of the message, and the
shim's setup and report, which must be our child's."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import pytest

from qlora_supervise.trainer_child.contract.attempt_facts import BatchInFlight
from qlora_supervise.trainer_child.contract.checkpoints import CHECKPOINT_COMPLETE_MARKER
from qlora_supervise.trainer_child.contract.codes import ExitCode, Stage
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DataSpec, DiagnoseSpec, Knobs, TrainSpec
from qlora_supervise.trainer_child.run import attempt, memory
from qlora_supervise.trainer_child.run.failure import ConfigError, capture, is_oom, oom_numbers
from qlora_supervise.trainer_child.shim.session import Session

CPU_MESSAGE = (
    "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: "
    "you tried to allocate 268435456 bytes. Error code 12 (Cannot allocate memory)"
)


def test_cpu_allocator_message_gives_tried_to_allocate() -> None:
    """The CPU allocator's message yields tried_to_allocate in bytes even without the shared parser."""
    assert oom_numbers(CPU_MESSAGE)["tried_to_allocate"] == 268435456


@pytest.mark.parametrize(
    "exc",
    [
        RuntimeError(CPU_MESSAGE),
        MemoryError(),
        RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
        RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    ],
)
def test_memory_failures_are_oom(exc: BaseException) -> None:
    """Each memory failure message or type is recognised as an OOM."""
    assert is_oom(exc)


def test_wrapped_oom_and_config_error_codes() -> None:
    """An OOM wrapped by a library keeps exit 70; a ConfigError gives 71; anything else 72."""
    try:
        try:
            raise MemoryError()
        except MemoryError as inner:
            raise ValueError("library wrapper") from inner
    except ValueError as exc:
        assert capture(exc, Stage.FORWARD, 3).exit_code is ExitCode.OOM
    assert capture(ConfigError("bad field"), Stage.LOAD, 0).exit_code is ExitCode.CONFIG
    assert capture(KeyError("x"), Stage.FORWARD, 0).exit_code is ExitCode.FAILED


def test_only_an_accelerators_oom_skips_the_gc_before_the_report() -> None:
    """torch.OutOfMemoryError is the device's allocator (the report then needs no host memory
    back); the CPU allocator's RuntimeError and Python's MemoryError are the host's."""
    import torch

    device = capture(
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), Stage.FORWARD, 3
    )
    host = capture(RuntimeError("DefaultCPUAllocator: can't allocate memory"), Stage.FORWARD, 3)
    python = capture(MemoryError(), Stage.FORWARD, 3)
    assert device.oom and device.device_oom
    assert host.oom and not host.device_oom
    assert python.oom and not python.device_oom
    assert not capture(ValueError("bad"), Stage.FORWARD, 3).device_oom


class _Left(Exception):
    """The shim ending the process, caught by the test instead."""


@pytest.fixture
def shim_session(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., Session]]:
    """A shim session in this process, its spec's files in ``tmp_path``; leaving raises :class:`_Left`."""

    def leave(self: Session, code: int) -> NoReturn:
        raise _Left(code)

    monkeypatch.setattr(sys, "excepthook", sys.excepthook)
    monkeypatch.setattr(attempt, "install_stop_handler", lambda progress: None)
    monkeypatch.setattr(Session, "leave", leave)
    made: list[Session] = []

    def make(**fields: Any) -> Session:
        files = {name: str(tmp_path / name) for name in ("events_file", "error_file", "checkpoints_dir")}
        spec = AttemptSpec(1, str(tmp_path), Knobs(model="m"), DataSpec(path="d"), TrainSpec(), **files,
                           adapter_dir=str(tmp_path / "adapter"), merged_dir="")  # fmt: skip
        made.append(Session(dataclasses.replace(spec, heartbeat_interval=60.0, **fields)))
        return made[-1]

    yield make
    for session in made:
        if session.ctx.heartbeat is not None:
            session.ctx.heartbeat.stop()
        session.ctx.events.close()


def test_the_shim_sets_up_as_our_child_does(
    shim_session: Callable[..., Session], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The shim records the allocator's history when the job asks (its OOM then leaves a snapshot) and
    warns of trust_remote_code, as our child does."""
    monkeypatch.setattr(memory, "start_memory_history", lambda diagnose: diagnose.memory_history)
    session = shim_session(
        train=TrainSpec(trust_remote_code=True), diagnose=DiagnoseSpec(memory_history=True)
    )
    assert session.ctx.memory_history
    assert attempt.TRUST_REMOTE_CODE_WARNING in capsys.readouterr().err


class _OomInForward:
    """A Trainer already attached, whose step runs out of memory on a known micro-batch."""

    BATCH = BatchInFlight(step=3, micro=1, lengths=(512, 80), rows=(41, 7))

    def __init__(self, session: Session) -> None:
        self.progress = session.ctx.progress

    def train(self, **kwargs: Any) -> None:
        self.progress.enter(Stage.FORWARD)
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 4096 bytes")

    def batch_in_flight(self) -> BatchInFlight:
        return self.BATCH

    def save_emergency_checkpoint(self) -> None:
        return None


def test_the_shims_oom_report_names_the_batch_in_flight(shim_session: Callable[..., Session]) -> None:
    """An OOM in the tool's training step reports the micro-batch it ran on, as our child's does."""
    session = shim_session()
    trainer = _OomInForward(session)
    session.ctx.trainer = trainer
    with pytest.raises(_Left):
        session.train(trainer, type(trainer).train, (), {})
    report = ErrorReport.from_json(Path(session.ctx.spec.error_file).read_text())
    assert report.exit_code == ExitCode.OOM and report.batch == _OomInForward.BATCH


def test_the_shim_names_the_checkpoint_that_fails_to_load(
    shim_session: Callable[..., Session], tmp_path: Path
) -> None:
    """A resume checkpoint that does not load is named in the shim's report, as in our child's."""
    damaged = tmp_path / "checkpoints" / "checkpoint-2"
    damaged.mkdir(parents=True)
    (damaged / CHECKPOINT_COMPLETE_MARKER).write_text("{}")  # complete, but no trainer_state.json
    session = shim_session(resume_from=str(damaged))
    with pytest.raises(_Left):
        session.train(object(), lambda trainer, **kwargs: None, (), {})
    report = ErrorReport.from_json(Path(session.ctx.spec.error_file).read_text())
    assert report.exit_code == ExitCode.CHECKPOINT and report.damaged_checkpoint == str(damaged)
