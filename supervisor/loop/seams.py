"""The loop's side effects behind small seams (the real ones are :class:`Seams`' defaults), so the
fake-clock tests run a whole ladder climb without a process; the real-process tests keep them."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from qlora_supervise.supervisor.loop import child as child_mod
from qlora_supervise.supervisor.watching.gpu import GpuMonitor, GpuProbe, RankCards
from qlora_supervise.supervisor.watching.host import oom_kill_count
from qlora_supervise.trainer_child.contract.spec import Knobs

Clock = Callable[[], float]
Sleep = Callable[[float], None]


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


class Spawn(Protocol):
    def __call__(
        self, argv: Sequence[str], env: Mapping[str, str], log_path: Path, cwd: Path
    ) -> ChildHandle: ...


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
    # The warm spare's start; None keeps none (a test's fake spawn has no spare).
    spawn_spare: SpawnSpare | None = child_mod.spawn_spare
    argv: Callable[[Path, str], list[str]] = child_mod.child_argv
    open_gpu: Callable[[str], GpuProbe | None] = GpuMonitor.open
    # Under torchrun, every rank's card for one attempt (None: not watched).
    open_cards: Callable[[Knobs, str], RankCards | None] = RankCards.open
    oom_kills: Callable[[], int | None] = oom_kill_count
    signal_child: Callable[[int, int], None] = _signal_child
    tick_s: float = 0.5
    sample_every_s: float = 2.0
    stop_grace_s: float = 180.0
    # Under torchrun: how long the other ranks may take to leave after one rank reported a failure.
    rank_shutdown_s: float = 30.0
