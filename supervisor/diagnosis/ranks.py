"""Several ranks failed together: which report is the cause, and which are knock-on effects
(a broken collective or a stop from torchrun after another rank's failure)."""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from qlora_supervise.supervisor.diagnosis import _signatures
from qlora_supervise.trainer_child.contract.codes import ExitCode
from qlora_supervise.trainer_child.contract.report import ErrorReport


@dataclasses.dataclass(frozen=True)
class RankCause:
    """The report that decides an attempt of several ranks, and the ranks that only followed it."""

    report: ErrorReport
    knock_on: tuple[int, ...]  # ranks whose reports were effects of the cause (sorted)
    why: str  # in words, for the evidence: "rank 1 (local rank 1) of 2 failed first; ..."


def is_knock_on(report: ErrorReport) -> bool:
    """A report of a rank that failed *because another one did*: a broken collective (not an OOM
    of its own), or a stop torchrun asked for."""
    if report.exit_code == ExitCode.STOPPED:
        return True
    if report.is_oom or report.config_error or report.disk_full:
        return False
    text = f"{report.exception_type}: {report.message}\n{report.traceback}"
    return _signatures.find(_signatures.KNOCK_ON, text) is not None


def first_failure(reports: Sequence[ErrorReport]) -> RankCause | None:
    """The cause among the ranks' reports (ties: the lower rank); None when none failed. When all are
    knock-on effects, the rank that failed first left none: the earliest stands for it, ``why`` says so."""
    failed = [r for r in reports if r.exit_code not in (ExitCode.OK, ExitCode.STOPPED)]
    if not failed:
        return None
    real = [r for r in failed if not is_knock_on(r)]
    cause = min(real or failed, key=lambda r: (r.time, r.rank))
    others = tuple(sorted(r.rank for r in reports if r is not cause))
    where = f"rank {cause.rank} (local rank {cause.local_rank}) of {cause.world_size}"
    if not real:
        why = f"{where} failed first, with a broken collective only: the rank that died first left no report"
    elif others:
        why = f"{where} failed first; rank(s) {', '.join(map(str, others))} followed (knock-on)"
    else:
        why = f"{where} failed"
    return RankCause(cause, others if real else (), why)


#: torchrun's summary of a failed run: the rank under "Root Cause (first observed failure)".
_ROOT_CAUSE = re.compile(r"Root Cause \(first observed failure\):\s*\[\d+\]:.*?rank\s*:\s*(\d+)", re.DOTALL)


def torchrun_root_rank(log_tail: str) -> int | None:
    """The rank torchrun saw fail first, from its summary in the child's log (when no report says)."""
    found = _ROOT_CAUSE.findall(log_tail)
    return int(found[-1]) if found else None
