"""Facts about a failed attempt: how the child ended, and the one record of what it failed of.

:class:`Failure` is both what the classifier returns and what the journal keeps
(``attempts.jsonl``'s ``failure`` object, :meth:`Failure.to_json` / :meth:`Failure.from_json`):
the report's facts the journal adds (the emergency checkpoint, expandable segments) are its
fields too, filled in once the report is known (``loop.outcome.failure_record``).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage


class KilledBy(str, enum.Enum):
    """Why the supervisor ended a child that had not exited on its own."""

    HANG = "hang"
    STOP = "stop"
    STEP_UP = "step_up"  # a planned restart to a faster config, at a checkpoint


@dataclasses.dataclass(frozen=True)
class ChildExit:
    """How a child process ended, as the supervisor saw it.

    ``returncode`` is None only while unknown; ``signal`` is set when a signal ended it (the
    number, e.g. 9 for SIGKILL). ``killed_by_supervisor`` says why the supervisor stopped it,
    None when the child ended on its own.
    """

    returncode: int | None
    signal: int | None = None
    killed_by_supervisor: KilledBy | None = None
    duration_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class XidFacts:
    """The NVML Xid events seen while an attempt ran (each code once, in the order seen) and the
    first fatal one among them (:func:`~qlora_supervise.supervisor.diagnosis.xid.fatal_xid`)."""

    codes: tuple[int, ...]
    fatal: int | None = None

    def numbers(self) -> dict[str, Any]:
        """The journal's keys for them, inside the failure's ``numbers``: ``xid``, ``fatal_xid``."""
        return {"xid": list(self.codes), **({"fatal_xid": self.fatal} if self.fatal is not None else {})}

    @classmethod
    def from_numbers(cls, numbers: Mapping[str, Any]) -> XidFacts | None:
        """The facts in a journal line's ``numbers``; None when it names no Xid."""
        codes = numbers.get("xid")
        fatal = numbers.get("fatal_xid")
        listed = tuple(code for code in codes if _is_int(code)) if isinstance(codes, list) else ()
        if not listed and not _is_int(fatal):
            return None
        return cls(listed or (fatal,), fatal if _is_int(fatal) else None)


_XID_KEYS = ("xid", "fatal_xid")


@dataclasses.dataclass(frozen=True)
class Failure:
    """A classified failure, as the classifier found it and the journal keeps it.

    ``numbers``: the allocator message's numbers in bytes (keys of
    :data:`qlora_supervise.trainer_child.contract.oom_message.NUMBER_KEYS`) plus what follows from them:
    ``reserved_unallocated`` / ``reserved_total`` when the wording prints only the other, and
    ``others_in_use`` (memory of other processes on the GPU); for a full disk, the bytes needed
    and free. ``evidence``: one sentence saying which source decided and why. ``message``: the
    error line it was read from, if any. ``rank`` / ``local_rank``: under torchrun, the rank whose
    report was the cause (the local rank is its GPU on the host); None for a single process or
    when no rank's report decided. ``gpu``: that rank's card, by its NVML (physical) index, where NVML
    watched it. ``xid``: the GPU faults that decided a ``gpu_fault``.
    ``emergency_checkpoint`` / ``expandable_segments_active``: the error report's, once known.
    """

    kind: FailureKind
    stage: Stage
    numbers: Mapping[str, Any]
    evidence: str
    message: str = ""
    rank: int | None = None
    local_rank: int | None = None
    gpu: int | None = None
    xid: XidFacts | None = None
    emergency_checkpoint: str | None = None
    expandable_segments_active: bool | None = None

    @property
    def fatal_xid(self) -> int | None:
        """The fatal Xid that decided this failure, if any (what the policy reads)."""
        return self.xid.fatal if self.xid is not None else None

    def numbers_json(self) -> dict[str, Any]:
        """The numbers as JSON keeps them: pids become string keys, bytes stay ints, and the Xid
        facts sit under ``xid`` / ``fatal_xid`` (the journal's shape since before :class:`XidFacts`)."""
        plain = {key: _plain(value) for key, value in self.numbers.items()}
        return {**plain, **(self.xid.numbers() if self.xid is not None else {})}

    def to_json(self) -> dict[str, Any]:
        """The ``failure`` object of an ``attempts.jsonl`` line (and of ``classify --json``)."""
        return {
            "kind": self.kind.value,
            "stage": self.stage.value,
            "numbers": self.numbers_json(),
            "evidence": self.evidence,
            "message": self.message,
            "emergency_checkpoint": self.emergency_checkpoint,
            "expandable_segments_active": self.expandable_segments_active,
            "rank": self.rank,
            "local_rank": self.local_rank,
            # Only where NVML named the card: lines written before it had none read back the same.
            **({"gpu": self.gpu} if self.gpu is not None else {}),
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Failure:
        """Read a journal line's ``failure``, written by this version or an older one (whose
        failure record had the same keys). Raises KeyError/ValueError without a known kind."""
        numbers = dict(raw.get("numbers") or {})
        return cls(
            kind=FailureKind(raw["kind"]),
            stage=Stage(raw.get("stage", "unknown")),
            numbers={key: value for key, value in numbers.items() if key not in _XID_KEYS},
            evidence=str(raw.get("evidence", "")),
            message=str(raw.get("message", "")),
            rank=raw.get("rank"),
            local_rank=raw.get("local_rank"),
            gpu=raw.get("gpu"),
            xid=XidFacts.from_numbers(numbers),
            emergency_checkpoint=raw.get("emergency_checkpoint"),
            expandable_segments_active=raw.get("expandable_segments_active"),
        )


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(key): item for key, item in value.items()}
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
