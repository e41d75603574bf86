"""Waiting out a full disk: the child's ``disk_full`` and the supervisor's own failed writes.

Both paths free what is the run's own to free (:func:`~..record.disk_room.free_ours`), say in
words where room is needed and how much, and poll the free space with the same backoff as the
memory wait (:func:`~.waiting.poll_until`, on the loop's clock), until there is room, the job's
``disk_wait`` has passed, or a stop was requested. Nothing here writes ``state.json``: on a full
disk it could not, and a supervisor killed while waiting resumes from the journal as always.
"""

from __future__ import annotations

import dataclasses
import signal

from structlog.typing import FilteringBoundLogger

from qlora_supervise.policies import decide as policy
from qlora_supervise.supervisor.exit_codes import SupervisorExitCode
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.jobfile.schema import SuperviseSection
from qlora_supervise.supervisor.loop.waiting import Pacer, poll_until
from qlora_supervise.supervisor.record.disk_room import (
    MIN_ROOM,
    free_ours,
    room_free,
    room_needed,
    room_words,
)
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract.codes import FailureKind


@dataclasses.dataclass
class DiskWaiter:
    """Frees, explains and waits; the arbiter owns one per run."""

    rd: RunDir
    log: FilteringBoundLogger
    pacer: Pacer  # the loop's clock and interruptible sleep
    wait_s: float
    pacing: tuple[float, float]  # the job's (initial, max) backoff between polls

    @classmethod
    def for_run(
        cls, rd: RunDir, log: FilteringBoundLogger, pacer: Pacer, supervise: SuperviseSection
    ) -> DiskWaiter:
        """The waiter of one run, paced by the job's ``supervise`` section."""
        return cls(rd, log, pacer, supervise.disk_wait, (supervise.backoff_initial, supervise.backoff_max))

    def verdict(self, stop_signal: int | None) -> int:
        """No room came back in time (exit 3), or a stop came first (resumable): nothing to journal."""
        if stop_signal is not None:
            self.log.info(Event.STOPPED, signal=signal.Signals(stop_signal).name, resumable=True)
            return 128 + int(stop_signal)
        why = f"no room on the disk for {self.wait_s:.0f}s (supervise.disk_wait)"
        self.log.error(Event.GAVE_UP, why=why, resumable="free space and run the same command again")
        return int(SupervisorExitCode.GAVE_UP)

    def explain(self, failure: Failure) -> Failure:
        """``other`` with no room left on the run's disk is ``disk_full``: a child that found the
        disk full may not have had room to say so (no report, a traceback it could not write)."""
        if failure.kind is not FailureKind.OTHER or room_free(self.rd) >= MIN_ROOM:
            return failure
        free = format_bytes(room_free(self.rd))
        why = f"{failure.evidence}; the run's disk has {free} free (below {format_bytes(MIN_ROOM)})"
        return dataclasses.replace(failure, kind=FailureKind.DISK_FULL, evidence=why)

    def with_room_needed(self, failure: Failure) -> Failure:
        """The child's ``disk_full`` with what it needs (at least the last checkpoint) and what is free."""
        self._free_ours()
        reported = failure.numbers.get("needed_bytes")
        needed = room_needed(self.rd, reported if isinstance(reported, int) else None)
        numbers = {**failure.numbers, "needed_bytes": needed, "free_bytes": room_free(self.rd)}
        return dataclasses.replace(failure, numbers=numbers)

    def wait(self, wait: policy.Wait) -> policy.WaitResult:
        """Carry out the policy's Wait for the disk: poll until ``needed_bytes`` are free."""
        free_now = room_free(self.rd)
        self.log.warning(
            Event.WAITING_FOR_DISK,
            why=wait.why,
            words=room_words(self.rd, wait.needed_bytes, free_now),
            needed_bytes=wait.needed_bytes,
            free_bytes=free_now,
            timeout_s=wait.seconds,
        )
        return self._poll(wait.needed_bytes, wait.seconds)

    def outlast(self, exc: OSError) -> bool:
        """The supervisor's own write failed for room: free, explain, wait. True: room is back."""
        self._free_ours()
        needed = room_needed(self.rd)
        free_now = room_free(self.rd)
        self.log.warning(
            Event.SUPERVISOR_DISK_FULL,
            error=str(exc),
            words=room_words(self.rd, needed, free_now),
            needed_bytes=needed,
            free_bytes=free_now,
            timeout_s=self.wait_s,
        )
        result = self._poll(needed, self.wait_s)
        return not result.stopped and result.free_bytes is not None and result.free_bytes >= needed

    def _poll(self, needed: int, timeout_s: float) -> policy.WaitResult:
        started = self.pacer.clock()
        free = poll_until(lambda: room_free(self.rd), needed, timeout_s, self.pacing, self.pacer)
        waited = self.pacer.clock() - started
        event = (
            Event.DISK_ROOM_AVAILABLE if free is not None and free >= needed else Event.DISK_WAIT_TIMED_OUT
        )
        self.log.info(event, free_bytes=free, needed_bytes=needed, waited_s=round(waited, 1))
        return policy.WaitResult(free, waited, stopped=self.pacer.stop_requested())

    def _free_ours(self) -> None:
        freed = free_ours(self.rd)
        if freed:
            self.log.info(Event.STAGING_FREED, freed_bytes=freed, where=str(self.rd.root))
