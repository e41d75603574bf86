"""The supervisor's reader of the child's events file: progress, loss and the child's one peak."""

from __future__ import annotations

from pathlib import Path

from qlora_supervise.supervisor.watching.watch import HeartbeatReader
from qlora_supervise.trainer_child.contract.codes import Stage
from qlora_supervise.trainer_child.contract.events import Heartbeat, MemoryNumbers, event_line


def test_reader_takes_the_peak_from_typed_heartbeats(tmp_path: Path) -> None:
    """Heartbeats written by the child's record give step, loss, throughput and the peak."""
    path = tmp_path / "child-events.jsonl"
    gauges = MemoryNumbers.measured(cuda_peak=None, data_segment_peak=300, rss_high_water=900)
    beats = [Heartbeat(Stage.FORWARD, 1, 2.5, 100.0, gauges), Heartbeat(Stage.BACKWARD, 2, 2.0, None)]
    path.write_text("".join(b.to_line() for b in beats))
    reader = HeartbeatReader(path)
    assert len(reader.poll(now=1.0)) == 2
    p = reader.progress
    assert (p.step, p.stage, p.loss, p.tokens_per_s, p.peak_bytes) == (2, "backward", 2.0, 100.0, 300)


def test_reader_reads_the_lines_before_a_torn_last_one(tmp_path: Path) -> None:
    """The reader takes every whole line, leaves a torn last one for the next poll; its peak: the largest."""
    path = tmp_path / "child-events.jsonl"
    lines = [
        event_line("loaded", rss_bytes=5, rss_high_water_bytes=70, vmdata_bytes=6, peak_bytes=60),
        event_line("heartbeat", stage="forward", step=1, loss=3.0, tokens_per_s=9.0, peak_bytes=80),
        event_line("heartbeat", stage="forward", step=2, loss=2.0, tokens_per_s=None, peak_bytes=40),
    ]
    path.write_text("".join(lines) + '{"event": "heartb')  # a torn last line waits for the next poll
    reader = HeartbeatReader(path)
    reader.poll(now=1.0)
    p = reader.progress
    assert (p.step, p.loss, p.tokens_per_s) == (2, 2.0, 9.0)
    assert p.peak_bytes == 80  # max over the lines' peaks
    assert [e.event for e in p.events] == ["loaded", "heartbeat", "heartbeat"]


def test_the_speed_trials_heartbeats_are_not_the_attempts_peak(tmp_path: Path) -> None:
    """The H200 case: a trial candidate peaked at 10.06 GB and the config trained at 8.22: the
    attempt's peak is the load's, then the training's (the child resets its peak after the trial)."""
    from qlora_supervise.trainer_child.contract.events import SpeedTrialEvent, TrialResult
    from qlora_supervise.trainer_child.contract.spec import TrialCandidate

    def beat(stage: Stage, step: int, peak: int) -> Heartbeat:
        memory = MemoryNumbers.measured(cuda_peak=peak, data_segment_peak=None, rss_high_water=None)
        return Heartbeat(stage, step, None, None, memory)

    chosen = TrialCandidate(8, 2, True)
    trial = SpeedTrialEvent((TrialResult(chosen, 9502.0, 8_205_357_568, 3.9),), 11.0)
    lines = [beat(Stage.LOAD, 0, 4_000_000_000).to_line(), beat(Stage.FORWARD, 0, 10_056_542_208).to_line(),
             trial.to_line(), beat(Stage.OPTIMIZER, 1, 8_222_597_632).to_line()]  # fmt: skip
    (tmp_path / "child-events.jsonl").write_text("".join(lines))
    reader = HeartbeatReader(tmp_path / "child-events.jsonl")
    reader.poll(now=1.0)
    assert reader.progress.peak_bytes == 8_222_597_632 and reader.progress.setup_peak == 4_000_000_000


def test_the_resume_loads_peak_is_setup_and_its_host_peak_is_not_trainings(tmp_path: Path) -> None:
    """The resume stage comes before the first micro-step: its GPU peak is part of the setup peak,
    and its host high-water mark is not training's host peak."""

    def beat(stage: Stage, step: int, peak: int, rss_high: int) -> Heartbeat:
        memory = MemoryNumbers.measured(cuda_peak=peak, data_segment_peak=None, rss_high_water=rss_high)
        return Heartbeat(stage, step, None, None, memory)

    lines = [
        beat(Stage.LOAD, 0, 4_000, 100),
        beat(Stage.RESUME, 5, 6_000, 900),
        beat(Stage.FORWARD, 6, 7_000, 300),
    ]
    (tmp_path / "child-events.jsonl").write_text("".join(b.to_line() for b in lines))
    reader = HeartbeatReader(tmp_path / "child-events.jsonl")
    reader.poll(now=1.0)
    p = reader.progress
    assert (p.setup_peak, p.host_peak, p.peak_bytes) == (6_000, 300, 7_000)
