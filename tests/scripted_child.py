"""A scripted stand-in for the trainer child (tests only): injected faults, real processes.

It speaks the real protocol (spec file in, heartbeats, checkpoints with the completion
marker, error report, reserved exit codes) but trains nothing, so the supervisor's loop can be
tested in seconds. What each attempt does comes from ``$SCRIPTED_CHILD_PLAN``, a JSON file:
``{"1": "oom_forward@3", "2": "hang@2", "default": "ok"}``. Behaviours:

* ``ok`` - train to max_steps, save the adapter, exit 0
* ``oom_forward@N`` / ``oom_backward@N`` - fail with a CUDA-style OOM report at step N,
  with an emergency checkpoint of step N-1 (``oom_optimizer@N``: none)
* ``fragmentation@N`` - an OOM whose numbers show reserved-but-unallocated memory
* ``hang@N`` - stop making progress at step N (heartbeats continue, the step does not)
* ``sigkill@N`` - kill itself with SIGKILL at step N (a host OOM kill when the test also
  bumps the cgroup ``oom_kill`` file named by ``$SCRIPTED_CHILD_OOM_EVENTS``)
* ``erofs@N`` - injected fault: the save at step N raises EROFS (a mount turned read-only)
* ``fill_disk`` - like ``ok``, then fills the disk to its last block with ``$SCRIPTED_CHILD_FILL``
  (a file the test deletes later): the supervisor's own next writes find no room
* ``killed@N`` - SIGKILLed at step N with no OOM sign (an operator's ``kill -9``, a preemption)
* ``contention@N`` - an OOM whose message shows another process holding most of the GPU
* ``config_error`` - exit with the config-error code and report
* ``slow`` - like ``ok`` but 0.5 s per step (for signal tests)
* ``corrupt_newest@N`` - injected fault: at step N truncate the newest checkpoint's adapter
  file (its marker keeps the old size and sha256), then die by SIGKILL
* ``sigkill_in_save@N`` - injected fault: die by SIGKILL at step N halfway through a save,
  leaving its ``.tmp-checkpoint-N-<pid>`` staging directory
* ``hang_hard@N`` - stop at step N in backward, ignoring SIGTERM (a process stuck in a kernel)

Pacing for the fault bench: ``$SCRIPTED_CHILD_STEP_S`` seconds per step (default 0.02; ``slow``:
0.5) and ``$SCRIPTED_CHILD_SAVE_S`` seconds in the middle of each checkpoint write (default 0),
so that kills land mid-run and mid-save. A resumed checkpoint's adapter file is read back, as a
real load would: a damaged one fails the attempt.

Checkpoints hold ``$SCRIPTED_CHILD_CKPT_BYTES`` bytes of padding (default none), are checked for
room before each save (``disk_space.ensure_room``, as the real trainer does), and a real
ENOSPC / EROFS while saving or reporting ends the attempt as the real child does: a report
with ``disk_full`` and exit ``DISK_FULL``, or that exit code alone when the report cannot be written.

* ``leak`` - leaks on purpose: its data-segment peak grows by 48 MiB a step from 256 MiB, and
  it dies of SIGKILL with ``Killed`` (a host OOM kill) at the step that would pass the job's
  ``cpu_memory_limit``; 0.15 s per step. Like the real trainer it takes the early-checkpoint
  signal (SIGUSR1) as "checkpoint at the end of this step and every later one"
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import hashlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from qlora_supervise.trainer_child.contract.checkpoints import CHECKPOINT_COMPLETE_MARKER
from qlora_supervise.trainer_child.contract.codes import ExitCode
from qlora_supervise.trainer_child.contract.disk_space import disk_facts, ensure_room, is_disk_full
from qlora_supervise.trainer_child.contract.durable import write_text_atomic
from qlora_supervise.trainer_child.contract.events import event_line
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import EARLY_CHECKPOINT_SIGNAL, AttemptSpec

OOM_MESSAGE = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
    "of 23.55 GiB of which 1.10 GiB is free. Including non-PyTorch memory, this process has 22.44 GiB "
    "memory in use. Of the allocated memory {alloc} is allocated by PyTorch, and {unalloc} is reserved "
    "by PyTorch but unallocated."
)


class Child:
    def __init__(self, spec: AttemptSpec) -> None:
        self.spec = spec
        self.events = open(spec.events_file, "a", encoding="utf-8")  # noqa: SIM115 - lives with the process
        self.step = _resume_step(spec)
        self.stop = False
        self.early = False
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(EARLY_CHECKPOINT_SIGNAL, self._on_early)

    def _on_term(self, _s: int, _f: object) -> None:
        self.stop = True

    def _on_early(self, _s: int, _f: object) -> None:
        self.early = True

    def emit(self, event: str, **fields: object) -> None:
        self.events.write(event_line(event, **fields))
        self.events.flush()

    def checkpoint(self, step: int, emergency: bool = False) -> str:
        root = Path(self.spec.checkpoints_dir)
        tmp = root / f".tmp-checkpoint-{step}-{os.getpid()}"
        ensure_room(root)
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "adapter.bin").write_text(json.dumps({"step": step, "r": self.spec.knobs.lora_r}) + " " * 100)
        padding = int(os.environ.get("SCRIPTED_CHILD_CKPT_BYTES", "0"))
        if padding:
            (tmp / "optimizer.pt").write_bytes(os.urandom(padding))
        time.sleep(float(os.environ.get("SCRIPTED_CHILD_SAVE_S", "0")))
        marker = {
            "step": step,
            "emergency": emergency,
            "knobs": dataclasses.asdict(self.spec.knobs),
            "files": file_digests(tmp),
        }
        early = self.early and not emergency
        (tmp / CHECKPOINT_COMPLETE_MARKER).write_text(json.dumps(marker))
        final = root / f"checkpoint-{step}"
        if final.exists():
            return str(final)
        tmp.rename(final)
        self.emit("checkpoint_saved", step=step, path=str(final), emergency=emergency, early=early)
        return str(final)

    def fail(self, stage: str, exc: str, message: str, code: ExitCode, emergency: bool) -> int:
        ckpt = self.checkpoint(self.step, emergency=True) if emergency and self.step > 0 else None
        report = ErrorReport(
            exit_code=int(code),
            exception_type=exc,
            message=message,
            traceback=f"Traceback (most recent call last):\n{exc}: {message}",
            stage=stage,
            step=self.step,
            is_oom=code == ExitCode.OOM,
            config_error=code == ExitCode.CONFIG,
            device="cuda:0",
            emergency_checkpoint=ckpt,
            emergency_step=self.step if ckpt else None,
        )
        write_text_atomic(self.spec.error_file, report.to_json())
        print(f"{exc}: {message}", file=sys.stderr)
        return int(code)

    def run(self, behaviour: str) -> int:
        try:
            return self._run(behaviour)
        except OSError as exc:
            if not is_disk_full(exc):
                raise
            return self.disk_full(exc)

    def disk_full(self, exc: OSError) -> int:
        """Like the real child: a report saying disk_full (when it fits), exit DISK_FULL."""
        report = ErrorReport(
            exit_code=int(ExitCode.DISK_FULL),
            exception_type=type(exc).__name__,
            message=str(exc),
            traceback="",
            stage="save",
            step=self.step,
            is_oom=False,
            disk_full=True,
            disk=disk_facts(self.spec.checkpoints_dir),
        )
        with contextlib.suppress(OSError):  # the report did not fit either: the exit code says it
            write_text_atomic(self.spec.error_file, report.to_json())
        with contextlib.suppress(OSError):  # stderr is child.log, on the same full disk
            print(f"{type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return int(ExitCode.DISK_FULL)

    def _run(self, behaviour: str) -> int:
        name, _, at = behaviour.partition("@")
        fail_at = int(at) if at else -1
        if name == "config_error":
            return self.fail(
                "load", "ConfigError", "target_modules ['q'] matched no layer", ExitCode.CONFIG, False
            )
        max_steps = self.spec.train.max_steps
        self.emit("started", pid=os.getpid(), max_steps=max_steps, step=self.step, stage="load")
        if name == "leak":
            return self._leak(max_steps)
        while self.step < max_steps:
            if self.stop:
                self.checkpoint(self.step)
                self.emit("stopping", step=self.step)
                return int(ExitCode.STOPPED)
            if self.step + 1 == fail_at:
                return self._fault(name)
            time.sleep(0.5 if name == "slow" else float(os.environ.get("SCRIPTED_CHILD_STEP_S", "0.02")))
            self.step += 1
            self.emit(
                "heartbeat",
                step=self.step,
                stage="forward",
                loss=2.0 / self.step,
                peak_bytes=1000 * self.step,
            )
            if self.step % self.spec.train.save_steps == 0:
                self.checkpoint(self.step)
        Path(self.spec.adapter_dir).mkdir(parents=True, exist_ok=True)
        (Path(self.spec.adapter_dir) / "adapter_config.json").write_text("{}")
        self.emit("finished", step=self.step)
        if name == "fill_disk":
            _fill(Path(os.environ["SCRIPTED_CHILD_FILL"]))
        return 0

    def _leak(self, max_steps: int) -> int:
        return _leak_run(self, max_steps)

    def _fault(self, name: str) -> int:
        if name in ("oom_forward", "oom_backward", "oom_optimizer"):
            stage = name.removeprefix("oom_")
            message = OOM_MESSAGE.format(alloc="21.90 GiB", unalloc="120.00 MiB")
            return self.fail(stage, "torch.OutOfMemoryError", message, ExitCode.OOM, stage != "optimizer")
        if name == "contention":
            message = (
                "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.00 GiB. "
                "GPU 0 has a total capacity of 23.55 GiB of which 200.00 MiB is free. "
                "Process 4242 has 18.00 GiB memory in use. "
                "Including non-PyTorch memory, this process has 5.30 GiB memory in use. "
                "Of the allocated memory 4.90 GiB is allocated by PyTorch, "
                "and 100.00 MiB is reserved by PyTorch but unallocated."
            )
            return self.fail("forward", "torch.OutOfMemoryError", message, ExitCode.OOM, True)
        if name == "fragmentation":
            message = OOM_MESSAGE.format(alloc="15.20 GiB", unalloc="6.90 GiB")
            return self.fail("backward", "torch.OutOfMemoryError", message, ExitCode.OOM, True)
        if name == "hang":
            while not self.stop:  # heartbeats go on, the step does not move
                self.emit("heartbeat", step=self.step, stage="forward")
                time.sleep(0.1)
            self.checkpoint(self.step)  # SIGTERM: like the real trainer, checkpoint and leave
            return int(ExitCode.STOPPED)
        if name == "corrupt_newest":
            newest = max(Path(self.spec.checkpoints_dir).glob("checkpoint-*"), key=_step_of)
            adapter = newest / "adapter.bin"
            adapter.write_bytes(adapter.read_bytes()[:10])
            os.kill(os.getpid(), signal.SIGKILL)
        if name == "sigkill_in_save":
            staging = Path(self.spec.checkpoints_dir) / f".tmp-checkpoint-{self.step}-{os.getpid()}"
            (staging / f"checkpoint-{self.step}").mkdir(parents=True)
            (staging / f"checkpoint-{self.step}" / "adapter.bin").write_text("half")
            os.kill(os.getpid(), signal.SIGKILL)
        if name == "hang_hard":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            while True:  # stuck: the stage and step never move, SIGTERM does nothing
                self.emit("heartbeat", step=self.step, stage="backward")
                time.sleep(0.1)
        if name == "erofs":
            raise OSError(errno.EROFS, "Read-only file system (injected)", self.spec.checkpoints_dir)
        if name == "killed":
            os.kill(os.getpid(), signal.SIGKILL)
        if name == "sigkill":
            events = os.environ.get("SCRIPTED_CHILD_OOM_EVENTS")
            if events:
                Path(events).write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
            print("Killed", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        raise SystemExit(f"unknown scripted behaviour {name!r}")


def file_digests(root: Path) -> dict[str, dict[str, object]]:
    """The marker's ``files`` entry (size and sha256 per file), as checkpoints.file_digests
    writes it; spelled out here so the scripted child speaks the file contract on its own."""
    return {
        p.name: {"size": p.stat().st_size, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
        for p in sorted(root.iterdir())
        if p.is_file()
    }


def _step_of(path: Path) -> int:
    return int(path.name.rsplit("-", 1)[-1])


def _fill(path: Path) -> None:
    """Write ``path`` until not one more byte fits (big chunks first, then ever smaller)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o640)
    try:
        chunk = 1 << 20
        while chunk:
            try:
                os.write(fd, b"\0" * chunk)
            except OSError:
                chunk //= 2
    finally:
        os.close(fd)


LEAK_BASE, LEAK_PER_STEP = 256 * 1024**2, 48 * 1024**2


def _leak_run(child: Child, max_steps: int) -> int:
    """The ``leak`` behaviour (module docstring)."""
    cap = child.spec.cpu_memory_limit or 1 << 40
    while child.step < max_steps:
        peak = LEAK_BASE + LEAK_PER_STEP * (child.step + 1)
        time.sleep(0.15)
        if peak > cap:  # the kernel's OOM killer, as a host whose RAM ran out would do it
            print("Killed", file=sys.stderr, flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        child.step += 1
        child.emit("heartbeat", step=child.step, stage="forward", peak_bytes=peak, peak_source="data_segment")
        if child.early:
            child.checkpoint(child.step)
    Path(child.spec.adapter_dir).mkdir(parents=True, exist_ok=True)
    child.emit("finished", step=child.step)
    return 0


def _resume_step(spec: AttemptSpec) -> int:
    if not spec.resume_from:
        return 0
    marker = json.loads((Path(spec.resume_from) / CHECKPOINT_COMPLETE_MARKER).read_text())
    json.loads((Path(spec.resume_from) / "adapter.bin").read_text())  # a real load reads the weights
    return int(marker["step"])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--spec", required=True)
    args = parser.parse_args()
    spec = AttemptSpec.from_json(Path(args.spec).read_text())
    plan = json.loads(Path(os.environ["SCRIPTED_CHILD_PLAN"]).read_text())
    behaviour = plan.get(str(spec.attempt), plan.get("default", "ok"))
    return Child(spec).run(behaviour)


if __name__ == "__main__":
    sys.exit(main())
