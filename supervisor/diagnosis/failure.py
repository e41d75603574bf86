"""Facts about a failed attempt: how the child ended, and what the classifier made of it."""

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
class Failure:
    """A classified failure.

    ``numbers``: the allocator message's numbers in bytes (keys of
    :data:`qlora_supervise.trainer_child.contract.oom_message.NUMBER_KEYS`) plus what follows from them:
    ``reserved_unallocated`` / ``reserved_total`` when the wording prints only the other, and
    ``others_in_use`` (memory of other processes on the GPU). ``evidence``: one sentence saying
    which source decided and why. ``message``: the error line it was read from, if any.
    ``rank`` / ``local_rank``: under torchrun, the rank whose report was the cause (the local
    rank is its GPU on the host); None for a single process or when no rank's report decided.
    """

    kind: FailureKind
    stage: Stage
    numbers: Mapping[str, Any]
    evidence: str
    message: str = ""
    rank: int | None = None
    local_rank: int | None = None

    def to_json_dict(self) -> dict[str, Any]:
        """The failure as plain JSON values (pids become string keys in JSON, bytes stay ints)."""
        return {
            "kind": self.kind.value,
            "stage": self.stage.value,
            "numbers": {key: _plain(value) for key, value in self.numbers.items()},
            "evidence": self.evidence,
            "message": self.message,
            "rank": self.rank,
            "local_rank": self.local_rank,
        }


def _plain(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {str(key): item for key, item in value.items()}
    return value
