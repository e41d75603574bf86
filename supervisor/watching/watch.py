"""What the loop watches while an attempt runs: host and GPU memory samples (each GPU sample appended to
``attempt-NNN/gpu.jsonl``) and the hang rule; a missing reading is never an error. The child's events file,
read as it grows, gives its progress (a change of step or stage: a heartbeat thread outliving a stuck training
is still hung); under torchrun one rank's peak well above the others' points at uneven batches or a device_map
(:func:`uneven`). **Memory creep** (:class:`CreepWatch`), a peak that rises step after step (a leak) towards
the budget: over the last :data:`WINDOW` steps after warm-up, a rise above the noise in all intervals but one
and a positive slope; said once per attempt, with an early checkpoint asked for when the line reaches the
budget within :data:`HORIZON_STEPS`."""

from __future__ import annotations

import itertools
import json
import math
import statistics
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

import psutil

from qlora_supervise.supervisor.facts.append import open_append_text
from qlora_supervise.supervisor.watching.gpu import GpuProbe, GpuSample, RankCards
from qlora_supervise.supervisor.watching.host import sample_host
from qlora_supervise.trainer_child.contract import events
from qlora_supervise.trainer_child.contract.codes import Stage
from qlora_supervise.trainer_child.contract.disk_space import DISK_ERRNOS
from qlora_supervise.trainer_child.contract.events import (
    ChildEvent,
    Heartbeat,
    Started,
    Stopping,
    parse_event,
)
from qlora_supervise.trainer_child.contract.spec import rank_files

#: The stages before the first micro-step (``starting``: before any event named one).
_BEFORE_TRAINING = frozenset({"starting", Stage.SETUP.value, Stage.LOAD.value, Stage.RESUME.value})


@dataclass
class Progress:
    """What the heartbeats have shown so far in one attempt (``stage``: ``starting`` before any)."""

    step: int = 0
    stage: str = "starting"
    loss: float | None = None
    tokens_per_s: float | None = None
    max_steps: int | None = None
    peak_bytes: int | None = None  # the child's own peak (CUDA allocator peak, or data segment on the CPU)
    setup_peak: int | None = None  # before anything trained or was timed: what a speed trial hands back
    # Host RSS: the load's high-water mark, training's (after the load), and the newest beat's RSS.
    load_host_peak: int | None = None
    host_peak: int | None = None
    last_rss: int | None = None
    last_event_at: float | None = None  # monotonic time of the newest line of any kind
    last_progress_at: float | None = None  # monotonic time the step or stage last changed
    finished: bool = False
    events: list[ChildEvent] = field(default_factory=list)


class HeartbeatReader:
    """Incremental reader: each :meth:`poll` consumes only the lines written since the last one."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = 0
        self._partial = ""
        self.progress = Progress()

    def poll(self, now: float) -> list[ChildEvent]:
        """New events since the last call, typed; updates :attr:`progress`; bad lines are skipped."""
        try:
            with self._path.open("r", encoding="utf-8") as handle:
                handle.seek(self._offset)
                chunk = handle.read()
                self._offset = handle.tell()
        except OSError:
            return []
        lines = (self._partial + chunk).split("\n")
        self._partial = lines.pop()  # a line still being written stays for the next poll
        new = [event for event in map(parse_event, lines) if event is not None]
        for event in new:
            self._apply(event, now)
        return new

    def _apply(self, event: ChildEvent, now: float) -> None:
        p = self.progress
        p.last_event_at = now
        step, stage = position(event)
        if (step is not None and step != p.step) or (stage is not None and stage.value != p.stage):
            p.last_progress_at = now
        if step is not None:
            p.step = max(p.step, step)
        if stage is not None:
            p.stage = stage.value
        match event:
            case Heartbeat(loss=loss, tokens_per_s=rate, memory=memory):
                p.loss = loss if loss is not None else p.loss
                p.tokens_per_s = rate if rate is not None else p.tokens_per_s
                p.last_rss = memory.rss_bytes if memory.rss_bytes is not None else p.last_rss
                if p.stage not in _BEFORE_TRAINING and memory.rss_high_water_bytes is not None:
                    p.host_peak = max(p.host_peak or 0, memory.rss_high_water_bytes)
            case events.Loaded():
                p.load_host_peak = event.memory.rss_high_water_bytes
            case Started(max_steps=int() as max_steps):
                p.max_steps = max_steps
            case events.Finished():
                p.finished = True
        # ``loaded`` carries memory numbers too; the peak rule is the child's.
        if isinstance(event, Heartbeat | events.Loaded) and event.memory.peak_bytes is not None:
            p.peak_bytes = max(p.peak_bytes or 0, event.memory.peak_bytes)
            if p.stage in _BEFORE_TRAINING:
                p.setup_peak = max(p.setup_peak or 0, event.memory.peak_bytes)
        if isinstance(event, events.SpeedTrialEvent):
            # The child reset its peaks after the trial: the attempt's is the load's, then training's.
            p.peak_bytes = p.setup_peak
            p.host_peak = None
        p.events.append(event)


def position(event: ChildEvent) -> tuple[int | None, Stage | None]:
    """The step and stage an event names, where it does (``unknown``, a newer child's, says nothing)."""
    match event:
        case Heartbeat() | Started() | Stopping() | events.StageEntered() | events.EarlyCheckpointRequested():
            return event.step, (None if event.stage is Stage.UNKNOWN else event.stage)
        case events.CheckpointSaved() | events.Finished():
            return event.step, None
    return None, None


UNEVEN_SHARE = 0.2  # "well above": the highest exceeds the lowest by this share of it
UNEVEN_MIN_BYTES = 64 * 1024 * 1024  # ... and by this many bytes (small models differ by noise)


@dataclass(frozen=True)
class UnevenPeaks:
    """One rank peaked well above the others (bytes)."""

    high_rank: int
    high_bytes: int
    low_rank: int
    low_bytes: int

    @property
    def share_above(self) -> float:
        return (self.high_bytes - self.low_bytes) / self.low_bytes


def read_rank_peaks(events_file: Path) -> dict[int, int]:
    """``{rank: peak bytes}`` from each rank's events file; a rank without a reading is left out."""
    readers = {rank: HeartbeatReader(Path(path)) for rank, path in rank_files(str(events_file))}
    for reader in readers.values():
        reader.poll(0.0)
    return {rank: r.progress.peak_bytes for rank, r in readers.items() if r.progress.peak_bytes}


def uneven(peaks: Mapping[int, int]) -> UnevenPeaks | None:
    """The highest and lowest rank when one peaked well above; None with fewer than two or none."""
    if len(peaks) < 2:
        return None
    high = max(peaks, key=lambda rank: (peaks[rank], -rank))
    low = min(peaks, key=lambda rank: (peaks[rank], rank))
    if (gap := peaks[high] - peaks[low]) < UNEVEN_MIN_BYTES or gap < UNEVEN_SHARE * peaks[low]:
        return None
    return UnevenPeaks(high, peaks[high], low, peaks[low])


WINDOW = 6
WARMUP_STEPS = 2
HORIZON_STEPS = 8
NOISE_FLOOR = 8 * 1024**2
NOISE_SHARE = 0.001


@dataclass(frozen=True)
class CreepForecast:
    step: int
    peak_bytes: int
    slope_bytes_per_step: float
    budget_bytes: int | None
    predicted_oom_step: int | None  # None: no budget to reach
    window_steps: int

    @property
    def asks_for_checkpoint(self) -> bool:
        return self.predicted_oom_step is not None


class CreepWatch:
    """Fed every heartbeat of one attempt; says once when memory creeps towards the budget."""

    def __init__(self, gpu_budget: int | None, cpu_budget: int | None, first_step: int = 0) -> None:
        source = events.ChildPeakSource
        self._budgets = {source.CUDA_ALLOCATOR: gpu_budget, source.DATA_SEGMENT: cpu_budget}
        self._first_step = first_step
        self._peaks: dict[int, int] = {}
        self._source: events.ChildPeakSource | None = None
        self.fired = False

    def observe(self, beat: Heartbeat) -> CreepForecast | None:
        peak = beat.memory.peak_bytes
        if self.fired or peak is None or beat.step <= self._first_step + WARMUP_STEPS:
            return None
        self._source = beat.memory.peak_source
        self._peaks[beat.step] = max(self._peaks.get(beat.step, 0), peak)
        for old in sorted(self._peaks)[:-WINDOW]:  # only the window is ever read
            del self._peaks[old]
        if (forecast := self._forecast()) is None:
            return None
        oom_step = forecast.predicted_oom_step  # None only without a budget
        if oom_step is not None and oom_step - forecast.step > HORIZON_STEPS:
            return None  # a leak, but the budget is still far: say so when it is near
        self.fired = True
        return forecast

    def _forecast(self) -> CreepForecast | None:
        steps = sorted(self._peaks)[-WINDOW:]
        if len(steps) < WINDOW:
            return None
        peaks = [self._peaks[step] for step in steps]
        noise = max(NOISE_FLOOR, NOISE_SHARE * peaks[-1])
        rises = sum(1 for before, after in itertools.pairwise(peaks) if after - before > noise)
        slope = statistics.linear_regression(steps, peaks).slope  # steps are distinct
        if rises < len(steps) - 2 or slope <= 0:
            return None
        budget = self._budgets.get(self._source) if self._source is not None else None
        step, peak = steps[-1], peaks[-1]
        reaches = None if budget is None else step + max(1, math.ceil((budget - peak) / slope))
        return CreepForecast(step, peak, slope, budget, reaches, len(steps))


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
    xid_events: list[int] = field(default_factory=list)  # NVML Xids during the attempt
    # Under torchrun: when a rank's failure report first showed, whether the others overstayed.
    rank_failed_at: float | None = None
    ranks_overstayed: bool = False
    rank_pids: dict[int, int] = field(default_factory=dict)  # from each rank's started event
    rank_exits: dict[int, float] = field(default_factory=dict)  # rank -> first seen gone
    # Under torchrun, per local rank: its card's NVML index, the child's peak there, its Xids.
    cards: dict[int, int] = field(default_factory=dict)
    card_peaks: dict[int, int] = field(default_factory=dict)
    card_xids: dict[int, list[int]] = field(default_factory=dict)


def hung(progress: Progress, started: float, now: float, timeout_s: float) -> bool:
    """No step or stage change for ``timeout_s`` (counted from the start until the first one)."""
    return now - (progress.last_progress_at or started) > timeout_s


def sample_memory(pid: int, watched: Watched, gpu: GpuProbe | None, gpu_log: Path) -> None:
    """One host sample and, where NVML answers, one GPU sample of the child's process tree."""
    host = sample_host(pid)
    watched.rss_peak = max(watched.rss_peak or 0, host.child_rss_bytes) or None
    sample = gpu.sample(pid_tree(pid)) if gpu is not None else None
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
    except OSError as exc:  # a diagnostic line lost to a full disk must not stop a child training fine
        if exc.errno not in DISK_ERRNOS:
            raise


def pid_tree(pid: int) -> set[int]:
    """The child and its descendants (dataloader workers hold GPU memory too)."""
    try:
        return {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
    except psutil.Error:
        return {pid}


def _sample_line(sample: GpuSample, rank: int | None = None) -> str:
    fields = asdict(sample) if rank is None else {"local_rank": rank, **asdict(sample)}
    return json.dumps(fields, default=str) + "\n"
