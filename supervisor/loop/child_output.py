"""What a child left for the supervisor to read and log once: its error reports (every rank's),
the rank cut on resume, an optimizer reset, and the ranks' peaks.

Shared by the runner (a watched attempt) and reclaim (the attempt of a supervisor that died).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.diagnosis.ranks import first_failure
from qlora_supervise.supervisor.loop.outcome import optimizer_reset
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.watching.heartbeats import Progress, read_rank_peaks, uneven
from qlora_supervise.trainer_child.contract.events import ChildEvent, Resumed
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import rank_files


def note_child_events(new: Sequence[ChildEvent], log: FilteringBoundLogger) -> None:
    """Log what the child reports once and a person wants to see at once: the rank cut on resume."""
    for event in new:
        if isinstance(event, Resumed) and event.rank_reduction is not None:
            log.info(
                Event.RANK_REDUCED,
                **dataclasses.asdict(event.rank_reduction),
                from_step=event.from_step,
                why="the smaller adapter starts from the truncated SVD of the trained update",
            )


def note_rank_peaks(events_file: Path, progress: Progress, log: FilteringBoundLogger) -> dict[int, int]:
    """Each rank's peak (torchrun): the attempt's peak becomes the highest of them (the card that
    limits the config), and one rank well above the others is logged with the numbers."""
    peaks = read_rank_peaks(events_file)
    if peaks:
        progress.peak_bytes = max(progress.peak_bytes or 0, *peaks.values())
    found = uneven(peaks)
    if found is not None:
        log.warning(
            Event.RANK_PEAKS_UNEVEN,
            high_rank=found.high_rank,
            high_peak_bytes=found.high_bytes,
            low_rank=found.low_rank,
            low_peak_bytes=found.low_bytes,
            share_above=round(found.share_above, 3),
            rank_peaks={str(rank): peak for rank, peak in peaks.items()},
            why="one rank's peak is well above the others': uneven per-rank batches (long samples on one "
            "rank) or gradient-sync buffers; check each rank's real batch and the device_map",
        )
    return peaks


def log_optimizer_reset(log: FilteringBoundLogger, progress: Progress) -> None:
    """``optimizer_reset`` when the child resumed with fresh optimizer state (planned, or because
    the checkpoint had none): the adapter and the LR schedule follow the step, the moments do not."""
    why = optimizer_reset(progress)
    if why is not None:
        log.warning(Event.OPTIMIZER_RESET, why=why, lr_schedule="restored at the resumed step")


def report_of(reports: tuple[ErrorReport, ...]) -> ErrorReport | None:
    """The one report that speaks for the attempt (under torchrun: the first real failure of all
    the ranks', :func:`~qlora_supervise.supervisor.diagnosis.ranks.first_failure`); None if none."""
    cause = first_failure(reports)
    if cause is not None:
        return cause.report
    return reports[0] if reports else None


def read_reports(rd: RunDir, number: int, log: FilteringBoundLogger) -> tuple[ErrorReport, ...]:
    """Every rank's error report of the attempt (``error.json``, ``error.rank1.json``, ...), in
    rank order; one that cannot be read is logged and left out."""
    found = []
    for _, path in rank_files(str(rd.attempt(number).error)):
        try:
            found.append(ErrorReport.from_json(Path(path).read_text(encoding="utf-8")))
        except (OSError, ValueError, TypeError) as exc:
            log.warning(Event.REPORT_UNREADABLE, path=path, error=str(exc))
    return tuple(found)
