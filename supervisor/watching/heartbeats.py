"""Reading the child's events file as it grows, into a picture of its progress.

Each line is parsed once (``contract.events.parse_event``). Progress is a change of step or stage:
a heartbeat repeating both is not, so a child whose heartbeat thread outlives a stuck training is
still seen as hung. The peak is the child's ``peak_bytes``, never re-derived here."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from qlora_supervise.trainer_child.contract.codes import Stage
from qlora_supervise.trainer_child.contract.events import (
    CheckpointSaved,
    ChildEvent,
    EarlyCheckpointRequested,
    Finished,
    Heartbeat,
    Loaded,
    SpeedTrialEvent,
    StageEntered,
    Started,
    Stopping,
    parse_event,
)

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
    # The peak before anything trained or was timed (setup and load): what a speed trial hands back.
    setup_peak: int | None = None
    # Host RSS (issue 28): the load's high-water mark (the ``loaded`` event), training's (the
    # heartbeats' after it: the child restarts the mark after the load on a GPU), and the newest
    # beat's RSS (what the host held when a kill came).
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
            case Heartbeat(loss=loss, tokens_per_s=rate):
                p.loss = loss if loss is not None else p.loss
                p.tokens_per_s = rate if rate is not None else p.tokens_per_s
            case Started(max_steps=int() as max_steps):
                p.max_steps = max_steps
            case Finished():
                p.finished = True
        # ``loaded`` carries memory numbers too; the peak rule is the child's.
        if isinstance(event, Heartbeat | Loaded) and event.memory.peak_bytes is not None:
            p.peak_bytes = max(p.peak_bytes or 0, event.memory.peak_bytes)
            if p.stage in _BEFORE_TRAINING:
                p.setup_peak = max(p.setup_peak or 0, event.memory.peak_bytes)
        _host(p, event)
        if isinstance(event, SpeedTrialEvent):
            # The heartbeats during the trial measured its candidates (the event has their peaks),
            # and the child reset its allocator's peak after it: the attempt's peak is the load's and
            # then the training's, not a candidate's it did not train with.
            p.peak_bytes = p.setup_peak
            p.host_peak = None  # and its host high-water mark restarts (the child resets VmHWM)
        p.events.append(event)


def _host(p: Progress, event: ChildEvent) -> None:
    if isinstance(event, Loaded):
        p.load_host_peak = event.memory.rss_high_water_bytes
    elif isinstance(event, Heartbeat):
        memory = event.memory
        p.last_rss = memory.rss_bytes if memory.rss_bytes is not None else p.last_rss
        if p.stage not in _BEFORE_TRAINING and memory.rss_high_water_bytes is not None:
            p.host_peak = max(p.host_peak or 0, memory.rss_high_water_bytes)


def position(event: ChildEvent) -> tuple[int | None, Stage | None]:
    """The step and stage an event names, where it does (``unknown``, a newer child's, says nothing)."""
    step: int | None = None
    stage: Stage | None = None
    match event:
        case Heartbeat() | StageEntered() | Stopping() | EarlyCheckpointRequested() | Started():
            step, stage = event.step, event.stage
        case CheckpointSaved() | Finished():
            step = event.step
    return step, (None if stage is Stage.UNKNOWN else stage)
