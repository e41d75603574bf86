"""Facts about a failed attempt: how the child ended, and :class:`Failure`, both what the classifier
returns and what the journal keeps (``attempts.jsonl``'s ``failure`` object)."""

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
    """How a child process ended: ``returncode`` None while unknown, ``signal`` the number of a
    signal that ended it, ``killed_by_supervisor`` None when the child ended on its own."""

    returncode: int | None
    signal: int | None = None
    killed_by_supervisor: KilledBy | None = None
    duration_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class XidFacts:
    """The NVML Xids seen while an attempt ran (each once, in order) and the first fatal one."""

    codes: tuple[int, ...]
    fatal: int | None = None

    def numbers(self) -> dict[str, Any]:
        """The journal's keys for them, inside the failure's ``numbers``: ``xid``, ``fatal_xid``."""
        return {"xid": list(self.codes), **({"fatal_xid": self.fatal} if self.fatal is not None else {})}

    @classmethod
    def from_numbers(cls, numbers: Mapping[str, Any]) -> XidFacts | None:
        """The facts in a journal line's ``numbers``; None when it names no Xid."""
        codes, fatal = numbers.get("xid"), numbers.get("fatal_xid")
        listed = tuple(code for code in codes if _is_int(code)) if isinstance(codes, list) else ()
        if not listed and not _is_int(fatal):
            return None
        return cls(listed or (fatal,), fatal if _is_int(fatal) else None)


_XID_KEYS = ("xid", "fatal_xid")
_PLAIN_FIELDS = ("emergency_checkpoint", "expandable_segments_active", "rank", "local_rank")


@dataclasses.dataclass(frozen=True)
class Failure:
    """A classified failure. ``numbers``: the allocator message's numbers in bytes (``oom_message.
    OomNumbers``) plus what follows from them (``others_in_use``: other processes' GPU memory), or
    a full disk's needed and free bytes. ``evidence``: which source decided and why. ``rank`` /
    ``local_rank``: under torchrun, the rank that caused it; ``gpu``: its card's NVML index.
    ``xid``: the faults that decided a ``gpu_fault``. The last two fields: the error report's."""

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
        """The numbers as JSON keeps them: string keys, and the Xid facts under ``xid`` / ``fatal_xid``."""
        plain = {key: _plain(value) for key, value in self.numbers.items()}
        return {**plain, **(self.xid.numbers() if self.xid is not None else {})}

    def to_json(self) -> dict[str, Any]:
        """The ``failure`` object of an ``attempts.jsonl`` line (and of ``classify --json``)."""
        head = {"kind": self.kind.value, "stage": self.stage.value, "numbers": self.numbers_json()}
        tail = {key: getattr(self, key) for key in ("evidence", "message", *_PLAIN_FIELDS)}
        # Only where NVML named the card: lines written before it had none read back the same.
        return {**head, **tail, **({"gpu": self.gpu} if self.gpu is not None else {})}

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> Failure:
        """Read a journal line's ``failure``; raises KeyError/ValueError without a known kind."""
        numbers = dict(raw.get("numbers") or {})
        kind, stage = FailureKind(raw["kind"]), Stage(raw.get("stage", "unknown"))
        evidence, message = str(raw.get("evidence", "")), str(raw.get("message", ""))
        plain = {key: value for key, value in numbers.items() if key not in _XID_KEYS}
        kept: dict[str, Any] = {key: raw.get(key) for key in (*_PLAIN_FIELDS, "gpu")}
        xid = XidFacts.from_numbers(numbers)
        return cls(kind, stage, plain, evidence=evidence, message=message, xid=xid, **kept)


def _plain(value: Any) -> Any:
    return {str(key): item for key, item in value.items()} if isinstance(value, Mapping) else value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
