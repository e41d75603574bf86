"""Reclaim: the attempt in flight when the supervisor itself died. Its child is found and stopped,
and what it left becomes an :class:`~.outcome.AttemptOutcome` with no exit status."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.loop import child as child_mod
from qlora_supervise.supervisor.loop.child_output import read_reports, report_of, seal_rank_parts
from qlora_supervise.supervisor.loop.outcome import AttemptOutcome, MemorySeen
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.loop.seams import Seams
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.journal import InFlight
from qlora_supervise.supervisor.record.records import AttemptRecord
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.trainers.launch import SHIM_SPEC_ENV
from qlora_supervise.supervisor.watching.heartbeats import HeartbeatReader
from qlora_supervise.trainer_child.contract import entry
from qlora_supervise.trainer_child.contract.processes import pid_alive


def reclaim(
    flight: InFlight, records: Sequence[AttemptRecord], rd: RunDir, seams: Seams, log: FilteringBoundLogger
) -> AttemptOutcome | None:
    """What the in-flight attempt left; None when the journal already holds its record."""
    if any(r.attempt == flight.number for r in records):
        return None  # its record was written; only state.json was stale
    spec_path = rd.attempt(flight.number).spec
    # PDEATHSIG normally ended the child already; the cmdline check keeps a reused pid safe and
    # finds a child whose pid was never recorded, torchrun's ranks, and a warm spare.
    for pid in attempt_children(flight.pid, spec_path, rd):
        log.warning(Event.ORPHAN_CHILD_STOPPING, attempt=flight.number, pid=pid)
        child_mod.stop_group(pid, seams.stop_grace_s)
    reader = HeartbeatReader(rd.attempt(flight.number).events)
    reader.poll(seams.clock())
    reports = read_reports(rd, flight.number, log)
    if flight.knobs.world_size > 1:
        reports = seal_rank_parts(rd.checkpoints, reports, flight.knobs, log)
    return AttemptOutcome(
        number=flight.number,
        plan=Plan(flight.phase, flight.knobs),
        exit=None,
        progress=reader.progress,
        report=report_of(reports),
        reports=reports if flight.knobs.world_size > 1 else (),
        memory=MemorySeen(),
        resumed_from=flight.resumed_from,
        started_at=flight.started_at,
        ended_at=seams.wall(),
        log_tail=child_mod.log_tail(rd.attempt(flight.number).log),
    )


def attempt_children(pid: int | None, spec_path: Path, rd: RunDir) -> list[int]:
    """The live processes of the attempt whose spec is ``spec_path``: the recorded pid, anything with
    the spec (or its attempt directory) on its command line, a warm spare of this run, and a foreign
    trainer whose environment points the shim at this spec."""
    spare = f"{entry.SPARE} --run-dir {rd.root}"
    shimmed = child_mod.pids_with_environment(SHIM_SPEC_ENV, str(spec_path))
    found = [*child_mod.pids_running(str(spec_path), spare), *shimmed]
    candidates = [pid, *(p for p in found if p != pid)] if pid else found
    return [
        p
        for p in dict.fromkeys(candidates)
        if (p in shimmed or _is_attempt_child(child_mod.process_cmdline(p), spec_path, rd)) and pid_alive(p)
    ]


def _is_attempt_child(cmdline: str, spec_path: Path, rd: RunDir) -> bool:
    """Its spec or attempt directory on the command line, or a warm spare of this run directory."""
    if str(spec_path) in cmdline or f"{spec_path.parent}{os.sep}" in cmdline:
        return True
    return entry.SPARE in cmdline and f"--run-dir {rd.root} " in f"{cmdline} "
