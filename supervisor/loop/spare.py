"""The warm spare (docs/recovery.md): one trainer child that has already imported the stack and
waits for a spec. It never changes the result: it gets an attempt only when that attempt's
environment and device equal its own (torch reads its allocator settings once), and what it does
ahead comes before the trainer seeds anything."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.facts.append import UnsafeRunPath, open_append_binary
from qlora_supervise.supervisor.loop.child import Clock, Sleep, SpareProcess, SpawnSpare
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.trainer_child.contract import processes

#: What a spare costs before it has reported its own RSS (0.9 GB measured on the H200, rounded up).
SPARE_RSS_GUESS = 2 << 30
#: Host RAM that must stay free beside the spare, for the running child's growth.
RAM_HEADROOM = 2 << 30
#: Fewer usable CPUs than this and ``auto`` keeps no spare.
MIN_CPUS_FOR_AUTO = 4
#: How long a spare that reported ready has to acknowledge a handed spec (``spare_ack``).
ACK_S = 5.0
#: A spare still importing when handed a spec may take until this long after its start to ack.
IMPORT_BOUND_S = 60.0
#: How often the hand-over looks for the acknowledgement.
ACK_POLL_S = 0.05


@dataclasses.dataclass(frozen=True)
class SpareOrder:
    """What a spare is started for: the environment and the device it was fixed with."""

    env: Mapping[str, str]
    device: str
    expandable_segments: bool
    # Hints, not part of the match: the model whose architecture it imports ahead, and the spec
    # whose tokenizer and rows it loads ahead (trainer_child/recipe/data.py; the attempt checks them).
    model: str = dataclasses.field(compare=False)
    prepare_from: Path | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass
class Spare:
    order: SpareOrder
    proc: SpareProcess
    started_at: float  # monotonic


def spare_enabled(setting: bool | str, cpus: int | None = None) -> tuple[bool, str]:
    """Whether this run keeps a spare, and why (for the log)."""
    if setting is False:
        return False, "supervise.warm_spare is false"
    usable = cpus if cpus is not None else len(os.sched_getaffinity(0))
    if setting == "auto" and usable < MIN_CPUS_FOR_AUTO:
        return False, (
            f"{usable} usable CPUs: a spare's imports would take a core from the trainer "
            "(set supervise.warm_spare: true to keep one anyway)"
        )
    return True, "on"


def runs_in_spare(argv: list[str], trainer_argv: list[str], train: bool, world_size: int) -> bool:
    """Whether a spare may run this attempt: one training process (no torchrun, no merge) whose
    command line is exactly the trainer's own (a tool's or a test's scripted child has another)."""
    return train and world_size == 1 and argv == trainer_argv


def room_for_spare(expected_rss: int, available: int | None = None) -> bool:
    """Whether what is free holds the spare plus headroom for the running child."""
    free = available if available is not None else int(psutil.virtual_memory().available)
    return free >= expected_rss + RAM_HEADROOM


def spare_argv(run_dir: Path, order: SpareOrder, python: str) -> list[str]:
    argv = [python, "-m", processes.SPARE, "--run-dir", str(run_dir)]
    argv += ["--device", order.device, "--model", order.model]
    if order.prepare_from is not None:
        argv += ["--prepare", str(order.prepare_from)]
    return argv + (["--expandable-segments"] if order.expandable_segments else [])


def ready_line(log_path: Path, pid: int, event: str = "spare_ready") -> dict[str, Any] | None:
    """The spare's ``spare_ready`` (or other ``event``) line from its log, once it has written it."""
    with contextlib.suppress(OSError):
        for line in log_path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                fields = json.loads(line)
                if isinstance(fields, dict) and fields.get("event") == event and fields.get("pid") == pid:
                    return fields
    return None


class SpareKeeper:
    """Keeps at most one spare; hands it to the next attempt whose environment it was made for."""

    def __init__(
        self, run_dir: Path, spawn: SpawnSpare | None, clock: Clock, sleep: Sleep, log: FilteringBoundLogger
    ) -> None:
        self.run_dir, self.log_path = run_dir, run_dir / "spare.log"
        self._spawn, self._clock, self._sleep, self._log = spawn, clock, sleep, log
        self.spare: Spare | None = None
        self.measured_rss: int | None = None

    def ensure(self, order: SpareOrder) -> None:
        """Have a spare for ``order`` (one for another is replaced); none if RAM is short or no ``spawn``."""
        if self._spawn is None:
            return
        if self.spare is not None and self.spare.order == order and self.spare.proc.poll() is None:
            return
        if self.spare is not None:
            self.discard("its environment no longer matches the next attempt's")
        expected = self.measured_rss or SPARE_RSS_GUESS
        if not room_for_spare(expected):
            self._log.info(Event.SPARE_SKIPPED, why="host RAM is short", expected_rss=expected)
            return
        argv = spare_argv(self.run_dir, order, sys.executable)
        try:
            proc = self._spawn(argv, dict(order.env), self.log_path, self.run_dir)
        except (OSError, UnsafeRunPath) as exc:  # a speed-up that cannot start must not stop the run
            self._log.warning(Event.SPARE_SKIPPED, why=f"it could not be started: {exc}")
            return
        self.spare = Spare(order, proc, self._clock())
        self._log.info(Event.SPARE_STARTED, pid=proc.pid, expected_rss=expected)

    def take(self, order: SpareOrder, spec_path: Path, log_path: Path) -> SpareProcess | None:
        """The spare, now running the attempt of ``spec_path``; None when there is no usable one. The
        hand-over waits for its ``spare_ack`` (:data:`ACK_S` once it reported ready, up to
        :data:`IMPORT_BOUND_S` from its start while it imports); one silent past that is killed, so the
        attempt starts cold at once, not at the hang timeout."""
        spare, self.spare = self.spare, None
        if spare is None:
            return None
        if spare.proc.poll() is not None:
            self._log.warning(Event.SPARE_DISCARDED, pid=spare.proc.pid, why="it had exited")
            return None
        if spare.order != order:
            self.spare = spare
            self.discard(_difference(spare.order, order))
            return None
        ready = ready_line(self.log_path, spare.proc.pid)
        self._note_rss(ready)
        # The attempt's log is created as for a cold child (0640, a regular file) before the spare appends.
        open_append_binary(log_path).close()
        sent = spare.proc.send_line(json.dumps({"spec": str(spec_path), "log": str(log_path)}))
        silent = self._await_ack(spare, ready is not None) if sent else "its stdin was closed"
        if silent is not None:
            spare.proc.stop(1.0)  # SIGTERM, then SIGKILL: a SIGSTOPped process ends by the SIGKILL
            self._log.warning(Event.SPARE_DISCARDED, pid=spare.proc.pid, why=silent)
            return None
        spare.proc.started_monotonic = self._clock()  # the attempt starts now, not at the spawn
        self._log.info(
            Event.SPARE_USED,
            pid=spare.proc.pid,
            ready=ready is not None,
            **{key: ready.get(key) if ready else None for key in ("import_s", "rss", "cuda_initialized")},
            waited_s=round(self._clock() - spare.started_at, 1),
        )
        return spare.proc

    def _await_ack(self, spare: Spare, ready: bool) -> str | None:
        """Wait for the spare's ``spare_ack``; None once seen, else why it is discarded."""
        bound = ACK_S if ready else max(ACK_S, IMPORT_BOUND_S - (self._clock() - spare.started_at))
        deadline = self._clock() + bound
        state = "after it reported ready" if ready else "and never reported ready (stuck in its imports?)"
        while True:
            if ready_line(self.log_path, spare.proc.pid, "spare_ack") is not None:
                return None
            if spare.proc.poll() is not None:
                return "it exited instead of acknowledging the spec"
            if self._clock() >= deadline:
                return f"no acknowledgement of the spec within {bound:.0f} s {state}: stopped or stuck"
            self._sleep(ACK_POLL_S)

    def discard(self, why: str) -> None:
        """Stop the spare, if any (it has no SIGTERM handler before it runs an attempt)."""
        spare, self.spare = self.spare, None
        if spare is None:
            return
        self._note_rss(ready_line(self.log_path, spare.proc.pid))
        spare.proc.stop(5.0)
        self._log.info(Event.SPARE_DISCARDED, pid=spare.proc.pid, why=why)

    def _note_rss(self, ready: dict[str, Any] | None) -> None:
        if ready is not None and isinstance(ready.get("rss"), int):
            self.measured_rss = int(ready["rss"])


def _difference(had: SpareOrder, wanted: SpareOrder) -> str:
    """The first thing that differs between a spare's order and the attempt's, for the log."""
    if had.device != wanted.device:
        return f"device changed ({had.device} -> {wanted.device})"
    changed = sorted(k for k in set(had.env) | set(wanted.env) if had.env.get(k) != wanted.env.get(k))
    return f"the environment changed: {', '.join(changed)}" if changed else "the allocator setting changed"
