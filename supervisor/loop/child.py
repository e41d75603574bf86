"""Starting and stopping the child process: in its own session (a Ctrl-C on the terminal reaches only the
supervisor, which stops the child on purpose), output appended to ``attempt-NNN/child.log``, and on Linux
``PDEATHSIG=SIGTERM`` (a child whose supervisor died checkpoints and exits). The command line is one process,
or for ``Knobs.world_size`` N > 1 torchrun's ranks (``python -m torch.distributed.run --standalone
--nproc-per-node N ...``; never a launcher of our own). ``--max-restarts 0``: retrying is the supervisor's
job, with a new config when the failure says so. ``--shutdown-timeout``: the supervisor's stop grace
(torchrun's 30 s could cut a GPU checkpoint short). The spec path stays on every rank's command line: reclaim
finds orphans by it."""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import psutil

from qlora_supervise.supervisor.facts.append import open_append_binary
from qlora_supervise.supervisor.record.rundir import RunDir, ensure_dir
from qlora_supervise.supervisor.trainers.trainer import SHIM_SPEC_ENV
from qlora_supervise.supervisor.watching.gpu import GpuMonitor, GpuProbe, RankCards
from qlora_supervise.supervisor.watching.host import oom_kill_count
from qlora_supervise.trainer_child.contract import processes
from qlora_supervise.trainer_child.contract.allocator import allocator_env
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, Knobs, rank_gpus, visible_entries

_PR_SET_PDEATHSIG = 1
#: torchrun's module, run with this interpreter so the ranks import the same packages as one child.
TORCHRUN_MODULE = "torch.distributed.run"
_SYSTEMD = ("NOTIFY_SOCKET", "WATCHDOG_USEC", "WATCHDOG_PID")
_TORCHRUN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "MASTER_ADDR")
_NOT_INHERITED = frozenset({*_SYSTEMD, *_TORCHRUN, "MASTER_PORT", "TORCHELASTIC_RUN_ID"})
#: Exit status of a child whose supervisor died between fork and exec.
ORPHANED_AT_START = 75
#: After the SIGKILL: how long to wait for the kernel to end the process (it cannot refuse).
_KILL_WAIT_S = 5.0
Clock = Callable[[], float]
Sleep = Callable[[float], None]


def command(spec_path: Path, phase: str, world_size: int = 1, shutdown_timeout_s: float = 180.0) -> list[str]:
    """The argv of one attempt; ``world_size`` > 1 starts that many ranks through torchrun."""
    if phase == "merge":
        return [sys.executable, "-m", processes.MERGE, "--spec", str(spec_path)]
    child = ["-m", processes.ATTEMPT, "--spec", str(spec_path)]
    if world_size <= 1:
        return [sys.executable, *child]
    grace = str(max(1, round(shutdown_timeout_s)))
    ranks = ["--standalone", "--nproc-per-node", str(world_size), "--max-restarts", "0"]
    return [sys.executable, "-m", TORCHRUN_MODULE, *ranks, "--shutdown-timeout", grace, *child]


def child_argv(spec_path: Path, phase: str) -> list[str]:
    """The argv for the spec at ``spec_path``; an unreadable spec starts one process, which reports it."""
    try:
        spec = AttemptSpec.from_json(spec_path.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError, KeyError):
        return command(spec_path, phase)
    if spec.command and phase != "merge":  # a foreign trainer (supervisor/trainers/): its own argv
        return list(spec.command)
    return command(spec_path, phase, spec.knobs.world_size, spec.stop_grace_s)


def child_env(base: Mapping[str, str], knobs: Knobs) -> dict[str, str]:
    """The caller's environment less the supervisor's (systemd's) and torchrun's (a rank's place), plus
    the allocator settings the knobs ask for (``contract.allocator.allocator_env``: the child checks)."""
    env = {k: v for k, v in base.items() if k not in _NOT_INHERITED}
    env["PYTHONUNBUFFERED"] = "1"
    # One string-hash seed for every attempt: set orders (peft's target_modules) match across
    # processes, so a restart, cold or warm, trains the numbers an uninterrupted process would.
    env.setdefault("PYTHONHASHSEED", "0")
    env.update(allocator_env(env, knobs.expandable_segments))
    if knobs.gpus:  # drop_rank left a card out: the ranks see only the others, in rank order
        env["CUDA_VISIBLE_DEVICES"] = rank_cards(env.get("CUDA_VISIBLE_DEVICES"), rank_gpus(knobs))
    return env


def rank_cards(visible: str | None, positions: list[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` naming the cards at ``positions`` of ``visible`` (unset: all GPUs)."""
    if (entries := visible_entries(visible)) is None:
        return ",".join(map(str, positions))
    return ",".join(entries[p] for p in positions if p < len(entries))


def _pdeathsig(parent: int) -> Callable[[], None]:
    def set_it() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            return  # not Linux: the supervisor's restart still reclaims the orphan from state.json
        if os.getppid() != parent:
            os._exit(ORPHANED_AT_START)  # the parent died before prctl: the signal would never come

    return set_it


@dataclass
class ChildProcess:
    """A running child. ``stop`` is SIGTERM to the group, a grace period, then SIGKILL."""

    popen: subprocess.Popen[bytes]
    started_monotonic: float

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        return self.popen.poll()

    def wait_for_exit(self, timeout_s: float, sleep: Callable[[float], None] = time.sleep) -> None:
        """Return when the child exits or ``timeout_s`` has passed (it does not reap: ``poll`` does).
        A pidfd wakes the watch at the exit itself (``poll(2)``: a pidfd may be above 1023); without
        pidfds (not Linux, or before 5.3) it sleeps the tick out."""
        if self.popen.poll() is not None:
            return
        try:
            pidfd = os.pidfd_open(self.popen.pid)
        except (AttributeError, OSError):
            sleep(timeout_s)
            return
        try:
            waiter = select.poll()
            waiter.register(pidfd, select.POLLIN)
            waiter.poll(max(0, int(timeout_s * 1000)))
        finally:
            os.close(pidfd)

    def send_line(self, line: str) -> bool:
        """Write one line to the child's stdin and close it (a spare's order); False: no pipe, or closed."""
        if (stdin := self.popen.stdin) is None:
            return False
        try:
            stdin.write(line.encode("utf-8") + b"\n")
            stdin.close()
        except (BrokenPipeError, ValueError, OSError):
            return False
        return True

    def stop(self, grace_s: float) -> int:
        """Stop the child and its group, and torchrun's ranks left at the end; its exit status."""
        ranks = trainer_pids(self.popen.pid) if self.popen.poll() is None else []
        if self.popen.poll() is None and (code := stop_group(self.popen.pid, grace_s)) is not None:
            # psutil reaped it: Popen must not wait for it again (it would read ECHILD as 0).
            self.popen.returncode = code
        code = self.popen.wait()
        # Grandchildren (dataloader workers) may outlive the leader; the group goes with it.
        for pid in dict.fromkeys([self.popen.pid, *ranks]):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        return code


def trainer_pids(pid: int) -> list[int]:
    """The trainer processes of a started child: itself, or torchrun's ranks when it is the launcher."""
    if TORCHRUN_MODULE not in process_cmdline(pid):
        return [pid]
    try:
        children = psutil.Process(pid).children()
    except psutil.Error:
        return []
    return [child.pid for child in children if processes.ATTEMPT in process_cmdline(child.pid)]


def spawn_child(
    argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path, stdin_pipe: bool = False
) -> ChildProcess:
    """Start the child; ``stdin_pipe`` gives it a pipe on stdin (a warm spare waits for its order there)."""
    ensure_dir(log_path.parent)
    with open_append_binary(log_path) as log:
        popen = subprocess.Popen(
            list(argv),
            env=dict(env),
            cwd=cwd,
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=_pdeathsig(os.getpid()),
        )
    return ChildProcess(popen, time.monotonic())


def spawn_spare(argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path) -> ChildProcess:
    """A warm spare (``trainer_child.spare``): a child that waits on its stdin pipe."""
    return spawn_child(argv, env, log_path, cwd, stdin_pipe=True)


def log_tail(path: Path, limit: int = 64 * 1024) -> str:
    """The last ``limit`` bytes of the child's log (the traceback is at the end)."""
    try:
        with path.open("rb") as handle:
            handle.seek(max(0, handle.seek(0, os.SEEK_END) - limit))
            return handle.read().decode("utf-8", errors="replace")
    except OSError:
        return ""


def pids_running(*arguments: str) -> list[int]:
    """Pids of processes whose command line contains any of ``arguments``."""
    procs = psutil.process_iter(["pid", "cmdline"])
    lines = ((int(p.info["pid"]), " ".join(p.info["cmdline"] or ())) for p in procs)
    return [pid for pid, cmdline in lines if any(argument in cmdline for argument in arguments)]


def process_cmdline(pid: int) -> str:
    """The process's command line, space-joined; empty when it is gone or not ours to read."""
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def stop_group(pid: int, grace_s: float) -> int | None:
    """SIGTERM to the process group ``pid`` leads, up to ``grace_s`` for ``pid`` to exit, then SIGKILL.
    ``pid``'s exit status (negative: a signal) when it is our child (psutil reaped it); None when it
    is not ours (an orphan: its new parent reaps it) or already gone."""
    try:
        leader = psutil.Process(pid)
        ours = leader.ppid() == os.getpid()
        os.killpg(pid, signal.SIGTERM)
    except (psutil.Error, ProcessLookupError, PermissionError):
        return None
    if not ours:  # psutil would wait on an orphan's zombie until its new parent reaps it
        if not _exited_within(pid, grace_s):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
            _exited_within(pid, _KILL_WAIT_S)
        return None
    gone, alive = psutil.wait_procs([leader], timeout=grace_s)
    if alive:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)
        gone, _ = psutil.wait_procs(alive, timeout=_KILL_WAIT_S)
    # wait_procs sets ``returncode`` on each process it saw end (documented; not in the stubs).
    code = getattr(gone[0], "returncode", None) if gone else None
    return int(code) if code is not None else None


def _exited_within(pid: int, timeout_s: float) -> bool:
    """Whether ``pid`` (not our child) exits, a zombie counting as exited, within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while processes.pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def attempt_children(pid: int | None, spec_path: Path, rd: RunDir) -> list[int]:
    """The live processes of the attempt whose spec is ``spec_path``: the recorded pid, anything with
    the spec (or its attempt directory) on its command line, a warm spare of this run, and a foreign
    trainer whose environment points the shim at this spec."""
    spare, shimmed = f"{processes.SPARE} --run-dir {rd.root}", []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get(SHIM_SPEC_ENV) == str(spec_path):
                shimmed.append(int(proc.info["pid"]))
        except psutil.Error:  # gone, or another user's: not ours to stop anyway
            continue
    found = [*pids_running(str(spec_path), spare), *shimmed]
    candidates = [pid, *(p for p in found if p != pid)] if pid else found
    return [
        p
        for p in dict.fromkeys(candidates)
        if (p in shimmed or _is_attempt_child(process_cmdline(p), spec_path, rd)) and processes.pid_alive(p)
    ]


def _is_attempt_child(cmdline: str, spec_path: Path, rd: RunDir) -> bool:
    if str(spec_path) in cmdline or f"{spec_path.parent}{os.sep}" in cmdline:
        return True
    return processes.SPARE in cmdline and f"--run-dir {rd.root} " in f"{cmdline} "


class ChildHandle(Protocol):
    """A started child as the loop drives it (:class:`child.ChildProcess` in production)."""

    @property
    def pid(self) -> int: ...

    @property
    def started_monotonic(self) -> float: ...

    def poll(self) -> int | None: ...

    def wait_for_exit(self, timeout_s: float, sleep: Callable[[float], None]) -> None:
        """Until it exits or ``timeout_s`` passes (a fake on a fake clock just sleeps)."""

    def stop(self, grace_s: float) -> int:
        """SIGTERM, up to ``grace_s`` to exit, then SIGKILL; the exit status (negative: a signal)."""


class SpareProcess(ChildHandle, Protocol):
    """A started warm spare; once taken, the attempt's child, its clock restarted at the hand-over."""

    started_monotonic: float

    def send_line(self, line: str) -> bool: ...


SpawnSpare = Callable[[list[str], Mapping[str, str], Path, Path], SpareProcess]
Spawn = Callable[[Sequence[str], Mapping[str, str], Path, Path], ChildHandle]  # argv, env, log, cwd


def _signal_child(pid: int, signum: int) -> None:
    # The trainer processes only, not the process group: torchrun would die of SIGUSR1, so under
    # it the signal goes to each rank (the ranks then agree to checkpoint together).
    for target in trainer_pids(pid):
        with contextlib.suppress(ProcessLookupError):  # it exited in between: nothing to ask
            os.kill(target, signum)


@dataclass
class Seams:
    """The loop's side effects (the real ones are the defaults): the fake-clock tests replace them to run
    a whole ladder climb without a process; the real-process tests keep them."""

    clock: Clock = time.monotonic
    wall: Clock = time.time
    sleep: Sleep = time.sleep
    spawn: Spawn = spawn_child
    spawn_spare: SpawnSpare | None = spawn_spare  # None keeps no warm spare (a test's fake spawn)
    argv: Callable[[Path, str], list[str]] = child_argv
    open_gpu: Callable[[str], GpuProbe | None] = GpuMonitor.open
    open_cards: Callable[[Knobs, str], RankCards | None] = RankCards.open  # torchrun: every rank's card
    oom_kills: Callable[[], int | None] = oom_kill_count
    signal_child: Callable[[int, int], None] = _signal_child
    tick_s: float = 0.5
    sample_every_s: float = 2.0
    stop_grace_s: float = 180.0
    rank_shutdown_s: float = 30.0  # torchrun: how long the others may take to leave after one failed
