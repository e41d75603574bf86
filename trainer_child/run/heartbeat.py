"""The child's events file (the contract's own records, read back by ``contract.events.parse_event``)
and its heartbeat thread."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from qlora_supervise.trainer_child.contract import events as records
from qlora_supervise.trainer_child.contract.codes import Stage
from qlora_supervise.trainer_child.run.memory import memory_numbers

LOOP_STAGES = frozenset({Stage.FORWARD, Stage.BACKWARD, Stage.OPTIMIZER})


class EventLog:
    """Appends event lines, each written and flushed whole under a lock (shared with the heartbeat thread)."""

    def __init__(self, path: str | Path) -> None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._handle = open(path, "a", encoding="utf-8")  # noqa: SIM115 - lives as long as the child
        self._lock = threading.Lock()

    def emit(self, event: str, **fields: Any) -> None:
        self.write(records.event_line(event, **fields))

    def write(self, line: str) -> None:
        with self._lock:
            self._handle.write(line)
            self._handle.flush()

    def close(self) -> None:
        with self._lock:
            self._handle.close()


class Progress:
    """Where the child is (stage, completed optimizer steps, last loss, throughput) and what the signals
    asked (SIGTERM: stop; EARLY_CHECKPOINT_SIGNAL: checkpoint after every step). Written by the main
    thread, read by the heartbeat thread: plain attribute writes are atomic enough."""

    def __init__(self, events: EventLog) -> None:
        self.events, self.stage, self.step = events, Stage.SETUP, 0
        self.loss: float | None = None
        self.tokens_per_s: float | None = None
        self.stop_requested = self.early_checkpoints = False
        self._announced: set[type] = set()

    def enter(self, stage: Stage) -> None:
        """Set the stage; a ``stage`` event marks a phase (load, training, eval, save), not each loop turn."""
        if stage is self.stage:
            return
        looping = self.stage in LOOP_STAGES and stage in LOOP_STAGES
        self.stage = stage
        if not looping:
            self.events.write(records.StageEntered(stage, self.step).to_line())

    def announce_stop(self) -> None:
        """Emit ``stopping`` once, from whichever thread sees the request first."""
        self._once(self.stop_requested, records.Stopping)

    def announce_early_checkpoints(self) -> None:
        self._once(self.early_checkpoints, records.EarlyCheckpointRequested)

    def _once(
        self, requested: bool, record: type[records.Stopping | records.EarlyCheckpointRequested]
    ) -> None:
        if requested and record not in self._announced:
            self._announced.add(record)
            self.events.write(record(self.stage, self.step).to_line())

    def beat(self, memory: records.MemoryNumbers | None = None) -> records.Heartbeat:
        memory = memory_numbers() if memory is None else memory
        return records.Heartbeat(self.stage, self.step, self.loss, self.tokens_per_s, memory)

    def heartbeat(self) -> None:
        self.events.write(self.beat().to_line())


class HeartbeatThread(threading.Thread):
    """Beats every ``interval`` s whatever the main thread does: a hang is ``step`` stuck, not a lost beat."""

    def __init__(self, progress: Progress, interval: float) -> None:
        super().__init__(name="qlora-heartbeat", daemon=True)
        self.progress, self.interval = progress, interval
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(self.interval):
            try:
                self.progress.announce_stop()
                self.progress.heartbeat()
            except (OSError, ValueError, MemoryError):  # file closed at exit, or no memory
                time.sleep(self.interval)

    def stop(self) -> None:
        self._done.set()
