"""The loop's side effects behind small seams, so the loop can run on a fake clock in tests.

Each seam is a ``Protocol``: the real one is the default of :class:`Seams`; the fake-clock
tier of tests replaces clock, sleep, spawn and the GPU probe and runs a whole ladder climb
without a process. The real-process tests keep the defaults (fakes lie).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from qlora_supervise.supervisor.loop import child as child_mod
from qlora_supervise.supervisor.loop.spare import SpawnSpare
from qlora_supervise.supervisor.watching.gpu import GpuMonitor, GpuProbe, RankCards
from qlora_supervise.supervisor.watching.host import oom_kill_count
from qlora_supervise.trainer_child.contract.spec import Knobs


class Clock(Protocol):
    def __call__(self) -> float: ...


class Sleep(Protocol):
    def __call__(self, seconds: float, /) -> None: ...


class ChildHandle(Protocol):
    """A started child as the loop drives it (:class:`child.ChildProcess` in production)."""

    @property
    def pid(self) -> int: ...

    @property
    def started_monotonic(self) -> float: ...

    def poll(self) -> int | None: ...

    def wait_for_exit(self, timeout_s: float, sleep: Callable[[float], None]) -> None:
        """Until it exits or ``timeout_s`` passes (a fake on a fake clock just sleeps)."""
        ...

    def stop(self, grace_s: float) -> int:
        """SIGTERM, up to ``grace_s`` to exit, then SIGKILL; the exit status (negative: a signal).

        The real child waits its grace in real time (``psutil.wait_procs``): a process needs that
        time to checkpoint. A fake child answers at once, so a fake-clock test pays no grace."""
        ...


class Spawn(Protocol):
    def __call__(
        self, argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path
    ) -> ChildHandle: ...


def _open_gpu(device: str) -> GpuProbe | None:
    return GpuMonitor.open(device)


def _signal_child(pid: int, signum: int) -> None:
    # The trainer processes only, not the process group: torchrun would die of SIGUSR1, so under
    # it the signal goes to each rank (the ranks then agree to checkpoint together).
    for target in child_mod.trainer_pids(pid):
        with contextlib.suppress(ProcessLookupError):  # it exited in between: nothing to ask
            os.kill(target, signum)


@dataclass
class Seams:
    """The loop's side effects, replaceable in tests."""

    clock: Clock = time.monotonic
    wall: Clock = time.time
    sleep: Sleep = time.sleep
    spawn: Spawn = child_mod.spawn_child
    # The warm spare's start (loop/spare.py); None keeps none (a test's fake spawn has no spare).
    spawn_spare: SpawnSpare | None = child_mod.spawn_spare
    argv: Callable[[Path, str], list[str]] = child_mod.child_argv
    open_gpu: Callable[[str], GpuProbe | None] = _open_gpu
    # Under torchrun, every rank's card for one attempt (its knobs name the cards; None: not watched).
    open_cards: Callable[[Knobs, str], RankCards | None] = RankCards.open
    oom_kills: Callable[[], int | None] = oom_kill_count
    signal_child: Callable[[int, int], None] = _signal_child
    tick_s: float = 0.5
    sample_every_s: float = 2.0
    stop_grace_s: float = 180.0
    # Under torchrun: how long the other ranks may take to leave after one rank reported a failure
    # (NCCL's shutdown of a broken collective takes up to ~30 s; torchrun would wait stop_grace).
    rank_shutdown_s: float = 30.0
