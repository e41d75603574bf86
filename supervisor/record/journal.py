"""The run directory's durable record. ``attempts.jsonl`` is the source of truth: one line per finished
attempt, fsynced before anything acts on its decision (a torn last line is ignored on read);
``state.json`` (written atomically) says what is in flight, so a supervisor killed at any moment
carries out a journalled decision or finishes or reclaims the in-flight attempt.
A line is plain JSON (its fields: docs/run-directory.md), written and read back whole through one
pydantic ``TypeAdapter``; a line that does not fit the record is unreadable (the journal counts it)."""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any

from pydantic import PlainSerializer, PlainValidator, TypeAdapter

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.rungs import Survives
from qlora_supervise.supervisor.facts.append import append_line
from qlora_supervise.supervisor.facts.failure import Failure
from qlora_supervise.supervisor.jobfile.bounds import json_loads
from qlora_supervise.trainer_child.contract.durable import write_text_atomic
from qlora_supervise.trainer_child.contract.spec import Knobs

JOURNAL_VERSION = 2
#: The failure in its own codec (pids as string keys, the Xid facts flat).
FailureField = Annotated[Failure, PlainValidator(lambda raw: _failure(raw)), PlainSerializer(Failure.to_json)]


def _failure(raw: Any) -> Failure:
    try:
        return Failure.from_json(raw)
    except (KeyError, TypeError, AttributeError) as error:  # only a ValueError reads as "unreadable"
        raise ValueError(f"not a failure: {error!r}") from None


QUARANTINE_RUNG = "quarantine_checkpoint"


class Phase(str, enum.Enum):
    """What an attempt's child does."""

    TRAIN = "train"
    MERGE = "merge"


class Outcome(str, enum.Enum):
    """How an attempt ended, as the journal records it."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"  # a stop signal: no verdict on the config
    INTERRUPTED = "interrupted"  # the supervisor died while it ran: no verdict either
    STEPPED_UP = "stepped_up"  # stopped at a checkpoint for a faster config (policies/ladder/step_up.py)


class Action(str, enum.Enum):
    """What the policy decided after a failure."""

    RESTART = "restart"
    GIVE_UP = "give_up"


class AttemptPeakSource(str, enum.Enum):
    """Where an attempt's peak came from, strongest first (see :func:`attempt_peak`)."""

    ALLOCATOR_REPORT = "allocator_report"  # the error report's allocator statistics at the failure
    OOM_MESSAGE = "oom_message"  # "N is allocated by PyTorch" + the request that failed
    HEARTBEAT = "heartbeat"  # the child's own allocator peak (data segment on the CPU)
    NVML = "nvml"  # what NVML saw the process hold (includes the CUDA context)
    RSS = "rss"  # host memory of the child, when nothing else was seen


@dataclass(frozen=True)
class Peak:
    """The one peak of an attempt: what the policy calibrates on and ``status`` prints."""

    bytes: int
    source: AttemptPeakSource


@dataclass(frozen=True)
class HostMemory:
    """An attempt's host RAM (bytes; None: not read): training's and the load's RSS high-water
    marks, the newest heartbeat's RSS, and the host model's prediction of training's."""

    peak_bytes: int | None = None
    load_peak_bytes: int | None = None
    last_rss_bytes: int | None = None
    predicted_bytes: int | None = None


def attempt_peak(
    report_peak: int | None,
    oom_need: int | None,
    heartbeat_peak: int | None,
    nvml_peak: int | None,
    rss_peak: int | None,
) -> Peak | None:
    """The attempt's peak: the first source with a reading wins, in :class:`AttemptPeakSource`'s
    order (the allocator's numbers count what the failed step needed; both are lower bounds of
    it, so the larger wins; heartbeats miss the last moments, NVML adds the CUDA context)."""
    if failed_step := max((p for p in (report_peak, oom_need) if p), default=None):
        from_report = failed_step == report_peak
        source = AttemptPeakSource.ALLOCATOR_REPORT if from_report else AttemptPeakSource.OOM_MESSAGE
        return Peak(int(max(failed_step, heartbeat_peak or 0)), source)
    later = zip((heartbeat_peak, nvml_peak, rss_peak), list(AttemptPeakSource)[2:], strict=True)
    return next((Peak(int(value), source) for value, source in later if value), None)


@dataclass(frozen=True)
class DecisionRecord:
    """The policy's verdict on a failed attempt: a restart with new knobs, or giving up."""

    action: Action
    why: str
    rung: str = ""
    changes: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)
    survives: Survives = Survives.ALL
    knobs: Knobs | None = None  # the next attempt's knobs (restart only)
    retryable: bool = True  # give up only: False means no config change can help (exit 4)
    waited_s: float = 0.0  # seconds spent waiting for memory before this decision
    undoes: int | None = None  # a step-up: the attempt whose rung it undoes

    @classmethod
    def of(cls, decision: policy.Restart | policy.GiveUp, waited_s: float = 0.0) -> DecisionRecord:
        d = decision
        if isinstance(d, policy.Restart):
            return cls(Action.RESTART, d.why, d.rung, dict(d.changes), d.survives, d.knobs, waited_s=waited_s)
        return cls(Action.GIVE_UP, d.why, retryable=d.retryable, waited_s=waited_s)

    @classmethod
    def retry_from_older(cls, knobs: Knobs, quarantined: str) -> DecisionRecord:
        """The restart after a checkpoint that would not load was quarantined: same knobs, the
        next older checkpoint (no verdict on the config)."""
        why = f"{quarantined} did not load and was quarantined; resume from the next older checkpoint"
        return cls(Action.RESTART, why, QUARANTINE_RUNG, {}, Survives.ALL, knobs)


@dataclass(frozen=True)
class PlanNote:
    """Why an attempt runs the config it runs, as the pre-flight chose it (attempt 1)."""

    predicted_peak: int | None  # bytes, the memory model's peak allocated for these knobs
    budget: int | None  # bytes the plan was made against (the cap, or the card less a reserve)
    why: tuple[str, ...]
    changes: Mapping[str, tuple[Any, Any]] = field(default_factory=dict)  # from the job as written
    quality_changed: bool = False  # seq_len or rank changed before the first attempt (said loudly)
    as_written: bool = False  # ``run --as-written``: the job's config, whatever the plan says


@dataclass(frozen=True)
class AttemptRecord:
    """One line of ``attempts.jsonl``: a finished attempt, its failure and the decision taken."""

    attempt: int
    phase: Phase
    knobs: Knobs
    outcome: Outcome
    started_at: float
    ended_at: float
    exit_code: int | None
    signal: int | None
    resumed_from: int
    steps_completed: int  # the last optimizer step this attempt finished
    next_resume_from: int | None  # where the next attempt starts (None: no next attempt)
    lost_steps: int  # finished steps the next attempt will not start from
    peak: Peak | None = None
    failure: FailureField | None = None
    decision: DecisionRecord | None = None
    plan: PlanNote | None = None  # the pre-flight's choice (attempt 1 of a run)
    optimizer_reset: str | None = None  # why the child resumed with fresh optimizer state
    host: HostMemory | None = None  # the attempt's host RAM against the host model's prediction
    # Knobs the attempt changed but the trainer did not take: the ladder moves on without them.
    unapplied: tuple[str, ...] = ()

    @property
    def steps_progressed(self) -> int:
        return max(0, self.steps_completed - self.resumed_from)

    @property
    def restarts(self) -> bool:
        return self.decision is not None and self.decision.action is Action.RESTART

    def to_line(self) -> str:
        raw = {"version": JOURNAL_VERSION, **_RECORD.dump_python(self, mode="json")}
        return json.dumps(raw, sort_keys=True) + "\n"

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> AttemptRecord:
        """Raises ValueError (pydantic's ValidationError) for a line this version cannot read."""
        return _RECORD.validate_python(raw)


_RECORD = TypeAdapter(AttemptRecord)


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

    Each transition in the arbiter is commented ``# RUNNING -> BACKOFF``."""

    STARTING = "starting"  # never written: nothing to resume from it (the journal says what comes next)
    RUNNING = "running"
    BACKOFF = "backoff"
    WAITING = "waiting"  # not written while waiting for room on a full disk (it could not be)
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


_STATE = TypeAdapter(State)


def write_state(path: Path, state: State) -> None:
    write_text_atomic(path, _STATE.dump_json(state, indent=2).decode())


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
        return json.dumps({"version": JOURNAL_VERSION, "lift": asdict(self)}) + "\n"


_LIFT = TypeAdapter(Lift)


def _lines(path: Path) -> tuple[list[AttemptRecord | Lift], int]:
    """The journal's attempts and lifts in order, and the number of lines that could not be read."""
    text = path.read_bytes().decode("utf-8", errors="replace") if path.is_file() else ""
    found: list[AttemptRecord | Lift] = []
    bad = 0
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            raw = json_loads(line)  # a line nested too deep is unreadable too, not a crash
            if not isinstance(raw, dict) or raw.get("version") != JOURNAL_VERSION:
                raise ValueError("not a journal line of this version")
            item = _LIFT.validate_python(raw["lift"]) if "lift" in raw else AttemptRecord.from_json(raw)
            found.append(item)
        except ValueError:
            bad += 1
    return found, bad


def append_lift(path: Path, lift: Lift) -> None:
    """Append a lift line, fsynced like an attempt's."""
    append_line(path, lift.to_line())


def read_lifts(path: Path) -> list[Lift]:
    """The journal's lifts, oldest first."""
    return [item for item in _lines(path)[0] if isinstance(item, Lift)]


def lifted_after(path: Path) -> int:
    """The attempt after which the newest lift lets the run go on (0: none)."""
    return next((lift.after_attempt for lift in reversed(read_lifts(path))), 0)


def read_attempts(path: Path) -> tuple[list[AttemptRecord], int]:
    """The journal's records and the number of lines that could not be read (torn or corrupt)."""
    items, bad = _lines(path)
    return [item for item in items if isinstance(item, AttemptRecord)], bad
