"""The run directory's durable record. ``attempts.jsonl`` is the source of truth: one line per finished
attempt, fsynced before anything acts on its decision (a torn last line is ignored on read);
``state.json`` (written atomically) says what is in flight, so a supervisor killed at any moment
carries out a journalled decision or finishes or reclaims the in-flight attempt."""

from __future__ import annotations

import dataclasses
import enum
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

from pydantic import Discriminator, Tag, TypeAdapter

from qlora_supervise.supervisor.facts.append import append_line
from qlora_supervise.supervisor.record.records import JOURNAL_VERSION, AttemptRecord, Phase
from qlora_supervise.trainer_child.contract.durable import write_text_atomic
from qlora_supervise.trainer_child.contract.spec import Knobs


class RunState(str, enum.Enum):
    """The supervisor's state machine (``loop/arbiter.py`` moves it; ``state.json`` saves it)::

        STARTING --plan--> RUNNING --child ended, judged--> the policy decides:
          ^  |                |    Restart, a changed config --------------> STARTING
          |  |                |    Restart, the same config --> BACKOFF ---> STARTING
          |  |                |    Wait (memory, disk room) --> WAITING ---> the policy decides again
          |  |                |    GiveUp ---------------------------------> STARTING
          |  |                +--  succeeded, interrupted -----------------> STARTING
          |  +--> SUCCEEDED | GAVE_UP | FAILED   (the plan is a verdict: adapter written, merged
          |                                       when asked; or the last decision gave up)
          +------ (every arrow into STARTING)
        any --> STOPPED   (SIGTERM/SIGINT; resumable: the same command continues)

    STARTING is never written (nothing to resume from it: the journal says what comes next), and
    neither is WAITING for room on a full disk (it could not be). Each transition in the arbiter is
    commented ``# RUNNING -> BACKOFF``.
    """

    STARTING = "starting"
    RUNNING = "running"
    BACKOFF = "backoff"
    WAITING = "waiting"
    SUCCEEDED = "succeeded"
    GAVE_UP = "gave_up"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(frozen=True)
class InFlight:
    """The attempt that is running (or was, when the supervisor died)."""

    number: int
    phase: Phase
    knobs: Knobs
    resumed_from: int
    pid: int | None
    started_at: float


@dataclass(frozen=True)
class State:
    run_state: RunState
    knobs: Knobs  # the knobs the next (or current) attempt runs with
    phase: Phase = Phase.TRAIN
    in_flight: InFlight | None = None
    reset_optimizer: bool = False  # the next attempt starts the optimizer afresh
    fresh_start: bool = False  # the next attempt must not resume (adapter shape changed)
    note: str = ""

    def to_json(self) -> str:
        return _STATE.dump_json(self, indent=2).decode()


_STATE = TypeAdapter(State)


def write_state(path: Path, state: State) -> None:
    write_text_atomic(path, state.to_json())


def read_state(path: Path) -> State | None:
    """The saved state, or None when absent or unreadable."""
    try:
        return _STATE.validate_json(path.read_bytes())
    except (OSError, ValueError):
        return None


def append_attempt(path: Path, record: AttemptRecord) -> None:
    """Append one line and fsync (``append_line``): the decision is durable before the loop acts."""
    append_line(path, record.to_line())


@dataclass(frozen=True)
class Lift:
    """A verdict lifted by a changed job or ``run --retry``: a journal line of its own,
    ``{"version": 2, "lift": {...}}``; the run goes on after ``after_attempt``."""

    after_attempt: int
    verdict: str  # the run state that was lifted: gave_up / failed
    why: str
    time: float

    def to_line(self) -> str:
        return json.dumps({"version": JOURNAL_VERSION, "lift": dataclasses.asdict(self)}) + "\n"


@dataclass(frozen=True)
class _LiftLine:
    lift: Lift


def _kind(raw: object) -> str | None:
    if not isinstance(raw, dict) or raw.get("version") != JOURNAL_VERSION:
        return None
    return "lift" if "lift" in raw else "attempt"


_LINE: TypeAdapter[AttemptRecord | _LiftLine] = TypeAdapter(
    Annotated[
        Annotated[AttemptRecord, Tag("attempt")] | Annotated[_LiftLine, Tag("lift")], Discriminator(_kind)
    ]
)


def _lines(path: Path) -> tuple[list[AttemptRecord | Lift], int]:
    """The journal's attempts and lifts in order, and the number of lines that could not be read."""
    if not path.is_file():
        return [], 0
    found: list[AttemptRecord | Lift] = []
    bad = 0
    for line in path.read_bytes().decode("utf-8", errors="replace").splitlines():
        if not line.strip():
            continue
        try:
            item = _LINE.validate_json(line)
        except ValueError:
            bad += 1
            continue
        found.append(item.lift if isinstance(item, _LiftLine) else item)
    return found, bad


def append_lift(path: Path, lift: Lift) -> None:
    """Append a lift line, fsynced like an attempt's."""
    append_line(path, lift.to_line())


def read_lifts(path: Path) -> list[Lift]:
    """The journal's lifts, oldest first."""
    return [item for item in _lines(path)[0] if isinstance(item, Lift)]


def lifted_after(path: Path) -> int:
    """The attempt after which the newest lift lets the run go on (0: none)."""
    lifts = read_lifts(path)
    return lifts[-1].after_attempt if lifts else 0


def read_attempts(path: Path) -> tuple[list[AttemptRecord], int]:
    """The journal's records and the number of lines that could not be read (torn or corrupt)."""
    items, bad = _lines(path)
    return [item for item in items if isinstance(item, AttemptRecord)], bad
