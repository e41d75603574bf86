"""What the loop watches while an attempt runs: host and GPU memory samples (each GPU sample appended
to ``attempt-NNN/gpu.jsonl``) and the hang rule. A missing reading is never an error."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import psutil

from qlora_supervise.supervisor.facts.append import open_append_text
from qlora_supervise.supervisor.watching.gpu import GpuProbe, GpuSample, RankCards
from qlora_supervise.supervisor.watching.heartbeats import CreepForecast, Progress
from qlora_supervise.supervisor.watching.host import sample_host
from qlora_supervise.trainer_child.contract.disk_space import DISK_ERRNOS


@dataclass
class Watched:
    """What one attempt showed while it ran. Mutable: updated every tick."""

    progress: Progress
    hang: bool = False
    stopped_by_signal: int | None = None
    gpu_peak_process: int | None = None
    gpu_others_at_end: int | None = None
    gpu_total: int | None = None
    gpu_others_sm_util: int | None = None  # the newest sample's (None: NVML did not say)
    rss_peak: int | None = None
    creep: CreepForecast | None = None  # memory creep seen (and an early checkpoint asked for)
    xid_events: list[int] = dataclasses.field(default_factory=list)  # NVML Xids during the attempt
    # Under torchrun: when a rank's failure report first showed, whether the others overstayed.
    rank_failed_at: float | None = None
    ranks_overstayed: bool = False
    rank_pids: dict[int, int] = dataclasses.field(default_factory=dict)  # from each rank's started event
    rank_exits: dict[int, float] = dataclasses.field(default_factory=dict)  # rank -> first seen gone
    # Under torchrun, per local rank: its card's NVML index, the child's peak there, its Xids.
    cards: dict[int, int] = dataclasses.field(default_factory=dict)
    card_peaks: dict[int, int] = dataclasses.field(default_factory=dict)
    card_xids: dict[int, list[int]] = dataclasses.field(default_factory=dict)


def hung(progress: Progress, started: float, now: float, timeout_s: float) -> bool:
    """No step or stage change for ``timeout_s`` (counted from the start until the first one)."""
    last = progress.last_progress_at or started
    return now - last > timeout_s


def sample_memory(pid: int, watched: Watched, gpu: GpuProbe | None, gpu_log: Path) -> None:
    """One host sample and, where NVML answers, one GPU sample of the child's process tree."""
    host = sample_host(pid)
    watched.rss_peak = max(watched.rss_peak or 0, host.child_rss_bytes) or None
    if gpu is None:
        return
    sample = gpu.sample(pid_tree(pid))
    if sample is not None:
        _note(watched, sample)
        _append(gpu_log, _sample_line(sample))


def sample_cards(pid: int, watched: Watched, cards: RankCards, gpu_log: Path) -> None:
    """One host sample and one of every rank's card (torchrun); the attempt's GPU numbers are the
    limiting card's: the highest peak, the most memory of others, the smallest total."""
    sample_memory(pid, watched, None, gpu_log)
    watched.cards = cards.indexes
    samples = cards.sample(pid_tree(pid))
    for rank, sample in samples.items():
        _note(watched, sample)
        watched.card_peaks[rank] = max(watched.card_peaks.get(rank, 0), sample.this_process_bytes)
        watched.card_xids.setdefault(rank, []).extend(sample.xid_events)
    if samples:
        watched.gpu_others_at_end = max(sum(b for _, b in s.others) for s in samples.values())
        watched.gpu_total = min(s.total for s in samples.values())
        _append(gpu_log, "".join(_sample_line(s, rank) for rank, s in samples.items()))


def _note(watched: Watched, sample: GpuSample) -> None:
    watched.gpu_peak_process = max(watched.gpu_peak_process or 0, sample.this_process_bytes)
    watched.gpu_others_at_end = sum(b for _, b in sample.others)
    watched.gpu_total = sample.total
    watched.gpu_others_sm_util = sample.others_sm_util
    watched.xid_events.extend(sample.xid_events)


def _append(gpu_log: Path, lines: str) -> None:
    try:
        with open_append_text(gpu_log) as handle:
            handle.write(lines)
    except OSError as exc:
        if exc.errno not in DISK_ERRNOS:
            raise
        # A diagnostic line lost to a full disk must not stop a child that is training fine.


def pid_tree(pid: int) -> set[int]:
    """The child and its descendants (dataloader workers hold GPU memory too)."""
    try:
        root = psutil.Process(pid)
        return {pid, *(c.pid for c in root.children(recursive=True))}
    except psutil.Error:
        return {pid}


def _sample_line(sample: GpuSample, rank: int | None = None) -> str:
    fields = dataclasses.asdict(sample)
    if rank is not None:
        fields = {"local_rank": rank, **fields}
    return json.dumps(fields, default=str) + "\n"
