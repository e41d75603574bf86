"""The warm spare: one trainer child that has already imported the stack and waits for a spec.

Why: an attempt spends most of its restart importing torch, transformers, peft, trl and
bitsandbytes (14-20 s of ~20 s on an H200, shared/gpu/README.md), and none of it depends on the
attempt. A spare started while the current attempt runs has paid it when the next one starts.

A spare never changes the result:

* **Environment.** It is started with exactly the environment the next attempt would get
  (:func:`child.child_env` of the current knobs) and is given an attempt only when that
  attempt's environment is equal key by key. torch reads its allocator settings once, when
  CUDA starts, so a spare started before ``expandable_segments`` changed is discarded (logged)
  and the attempt starts cold, with a new spare started behind it.
* **Device.** Its prelude binds the device with the same ``contract.devices.bind_device`` as an
  attempt, from the same job field; the spare checks the spec's device once more.
* **Seeds.** What it does ahead (imports, a model on the meta device, the tokenizer and rows of
  ``trainer_child/prepared.py``) comes before the trainer seeds every generator from the spec.

No spare when the run would not gain from one or could lose by it: ``supervise.warm_spare:
false``; ``auto`` on a host with fewer than 4 usable CPUs (its imports would take a core from
the trainer); more than one process (torchrun starts the ranks itself); the merge phase (its own
low-memory process); and host RAM short (see :func:`room_for_spare`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import psutil
from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.facts.append import UnsafeRunPath, open_append_binary
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.trainer_child.contract import entry

#: What a spare costs before it has reported its own RSS: a Python process with the stack
#: imported (0.9 GB with the CUDA build of torch on the H200: bench/results/recovery-h200-2026-12-01/
#: spare/, docs/recovery.md), rounded up.
SPARE_RSS_GUESS = 2 << 30
#: Host RAM that must stay free beside the spare, for the running child's growth.
RAM_HEADROOM = 2 << 30
#: Fewer usable CPUs than this and ``auto`` keeps no spare.
MIN_CPUS_FOR_AUTO = 4
#: How long a spare that reported ready has to acknowledge a handed spec (``spare_ack``): it
#: does so before any work, so only a stopped or wedged process misses it.
ACK_S = 5.0
#: A spare not ready yet when handed a spec is still importing: it may take until this long after
#: its start (the stack's imports take 14-20 s on an H200) before it acks; one still silent then
#: is stuck in an import. The supervisor waits in the hand-over; a cold child would need as long.
IMPORT_BOUND_S = 60.0
#: How often the hand-over looks for the acknowledgement.
ACK_POLL_S = 0.05


class SpareProcess(Protocol):
    """A started spare as the keeper drives it (:class:`child.ChildProcess` in production); once
    taken it is the attempt's child, its clock restarted at the hand-over."""

    started_monotonic: float

    @property
    def pid(self) -> int: ...

    def poll(self) -> int | None: ...

    def send_line(self, line: str) -> bool: ...

    def wait_for_exit(self, timeout_s: float, sleep: Callable[[float], None]) -> None: ...

    def stop(self, grace_s: float) -> int: ...


SpawnSpare = Callable[[list[str], Mapping[str, str], Path, Path], SpareProcess]


@dataclasses.dataclass(frozen=True)
class SpareOrder:
    """What a spare is started for: the environment and the device it was fixed with."""

    env: Mapping[str, str]
    device: str
    expandable_segments: bool
    # Only a hint (the architecture module to import ahead): a spare warmed for another model
    # still saves the rest, so the model is not part of the match.
    model: str = dataclasses.field(compare=False)
    # Also a hint: the spec of the attempt it is started behind, whose tokenizer and rows it
    # loads ahead (trainer_child/prepared.py); the attempt checks they are its own.
    prepare_from: Path | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass
class Spare:
    order: SpareOrder
    proc: SpareProcess
    started_at: float  # monotonic


def spare_enabled(setting: bool | str, cpus: int | None = None) -> tuple[bool, str]:
    """Whether this run keeps a spare, and why (for the log). Whether a given attempt can use
    it is the runner's question: only one that runs the trainer's own command line."""
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
    """Whether a spare may run this attempt: one training process (never torchrun's ranks, whose
    command is the launcher, nor a merge) whose command line is exactly the trainer's own (a
    test's scripted child has another)."""
    return train and world_size == 1 and argv == trainer_argv


def room_for_spare(expected_rss: int, available: int | None = None) -> bool:
    """Host RAM is short when what is free could not hold the spare plus headroom for the child."""
    free = available if available is not None else int(psutil.virtual_memory().available)
    return free >= expected_rss + RAM_HEADROOM


def spare_argv(run_dir: Path, order: SpareOrder, python: str) -> list[str]:
    argv = [python, "-m", entry.SPARE, "--run-dir", str(run_dir)]
    argv += ["--device", order.device, "--model", order.model]
    if order.prepare_from is not None:
        argv += ["--prepare", str(order.prepare_from)]
    return argv + (["--expandable-segments"] if order.expandable_segments else [])


def ready_line(log_path: Path, pid: int) -> dict[str, Any] | None:
    """The spare's ``spare_ready`` report from its log, once it has written it."""
    return _spare_line(log_path, pid, "spare_ready")


def ack_line(log_path: Path, pid: int) -> dict[str, Any] | None:
    """The spare's ``spare_ack`` of a handed spec from its log, once it has written it."""
    return _spare_line(log_path, pid, "spare_ack")


def _spare_line(log_path: Path, pid: int, event: str) -> dict[str, Any] | None:
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
        self,
        run_dir: Path,
        spawn: SpawnSpare,
        clock: Callable[[], float],
        sleep: Callable[[float], None],
        log: FilteringBoundLogger,
        python: str,
    ) -> None:
        self.run_dir = run_dir
        self.log_path = run_dir / "spare.log"
        self._spawn, self._clock, self._sleep, self._log, self._python = spawn, clock, sleep, log, python
        self.spare: Spare | None = None
        self.measured_rss: int | None = None

    def ensure(self, order: SpareOrder) -> None:
        """Have a spare for ``order`` (one for another order is replaced); no spare if RAM is short."""
        if self.spare is not None and self.spare.order == order and self.spare.proc.poll() is None:
            return
        if self.spare is not None:
            self.discard("its environment no longer matches the next attempt's")
        expected = self.measured_rss or SPARE_RSS_GUESS
        if not room_for_spare(expected):
            self._log.info(Event.SPARE_SKIPPED, why="host RAM is short", expected_rss=expected)
            return
        argv = spare_argv(self.run_dir, order, self._python)
        try:
            proc = self._spawn(argv, dict(order.env), self.log_path, self.run_dir)
        except (OSError, UnsafeRunPath) as exc:  # a speed-up that cannot start must not stop the run
            self._log.warning(Event.SPARE_SKIPPED, why=f"it could not be started: {exc}")
            return
        self.spare = Spare(order, proc, self._clock())
        self._log.info(Event.SPARE_STARTED, pid=proc.pid, expected_rss=expected)

    def take(self, order: SpareOrder, spec_path: Path, log_path: Path) -> SpareProcess | None:
        """The spare, now running the attempt of ``spec_path``; None when there is no usable one.

        The hand-over waits (here, in the loop) for the spare's ``spare_ack``: :data:`ACK_S` once
        it reported ready, up to :data:`IMPORT_BOUND_S` from its start while it still imports. A
        spare silent past that (SIGSTOPped, wedged in an import) is killed and None returned, so
        the attempt starts cold at once rather than being found by the hang timeout.
        """
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
        # The supervisor creates the attempt's log as it would for a cold child (0640, a regular
        # file, no link) before the spare opens it for appending.
        open_append_binary(log_path).close()
        if not spare.proc.send_line(json.dumps({"spec": str(spec_path), "log": str(log_path)})):
            self._log.warning(Event.SPARE_DISCARDED, pid=spare.proc.pid, why="its stdin was closed")
            spare.proc.stop(1.0)
            return None
        silent = self._await_ack(spare, ready is not None)
        if silent is not None:
            spare.proc.stop(1.0)  # SIGTERM, then SIGKILL: a SIGSTOPped process ends by the SIGKILL
            self._log.warning(Event.SPARE_DISCARDED, pid=spare.proc.pid, why=silent)
            return None
        spare.proc.started_monotonic = self._clock()  # the attempt starts now, not at the spawn
        self._log.info(
            Event.SPARE_USED,
            pid=spare.proc.pid,
            ready=ready is not None,
            import_s=ready.get("import_s") if ready else None,
            rss=ready.get("rss") if ready else None,
            cuda_initialized=ready.get("cuda_initialized") if ready else None,
            waited_s=round(self._clock() - spare.started_at, 1),
        )
        return spare.proc

    def _await_ack(self, spare: Spare, ready: bool) -> str | None:
        """Wait for the spare's ``spare_ack``; None once seen, else why it is discarded."""
        bound = ACK_S if ready else max(ACK_S, IMPORT_BOUND_S - (self._clock() - spare.started_at))
        deadline = self._clock() + bound
        while True:
            if ack_line(self.log_path, spare.proc.pid) is not None:
                return None
            if spare.proc.poll() is not None:
                return "it exited instead of acknowledging the spec"
            if self._clock() >= deadline:
                state = (
                    "after it reported ready" if ready else "and never reported ready (stuck in its imports?)"
                )
                return f"no acknowledgement of the spec within {bound:.0f} s {state}: stopped or stuck"
            self._sleep(ACK_POLL_S)

    def discard(self, why: str) -> None:
        """Stop the spare, if any: SIGTERM to its group (it has no handler before it runs an
        attempt, so it ends at once, importing or waiting), SIGKILL after a short grace."""
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
