"""The child's events read back once: one typed record per line, from the lines the child writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from qlora_supervise.supervisor.watching import watch
from qlora_supervise.supervisor.watching.watch import HeartbeatReader
from qlora_supervise.trainer_child.contract import events
from qlora_supervise.trainer_child.contract.attempt_facts import RankReduction, SampleLengths
from qlora_supervise.trainer_child.contract.codes import Stage
from qlora_supervise.trainer_child.contract.events import (
    EVENT_NAMES,
    ChildEvent,
    ChildPeakSource,
    EarlyCheckpointRequested,
    Heartbeat,
    Loaded,
    MemoryNumbers,
    SpeedTrialEvent,
    StageEntered,
    Stopping,
    TrialResult,
    event_line,
    parse_event,
)
from qlora_supervise.trainer_child.contract.spec import TrialCandidate
from qlora_supervise.trainer_child.run.heartbeat import EventLog, Progress

ROOT = Path(__file__).resolve().parent.parent
GPU_MEMORY = MemoryNumbers.measured(
    cuda_peak=7 << 30, data_segment_peak=3 << 30, rss_high_water=2 << 30, allocated=6 << 30, reserved=8 << 30
)
LENGTHS = SampleLengths(3, (12, 40, 700))
CUT = RankReduction(16, 8, 128, 0.93, 0.71, "layers.3.self_attn.v_proj")

#: What each emit site of the child passes to ``EventLog.emit`` (trainer_child/run/attempt.py,
#: recipe/qlora.py, recipe/trainer.py, merge/process.py), by event name.
EMITTED: dict[str, dict[str, Any]] = {
    "started": {
        "pid": 4242, "attempt": 2, "rank": 0, "local_rank": 0, "world_size": 1, "device": "cuda",
        "device_name": "NVIDIA H200", "versions": {"torch": "2.13.0", "peft": "0.17.1"}, "vmdata": 1 << 30,
        "rss": 1 << 29, "cpu_memory_limit": None, "gpu_memory_limit": 8 << 30,
        "expandable_segments_active": False, "cpu_fallback": None, "trust_remote_code": False,
    },
    "loaded": {
        "trainable_params": 4_194_304, "total_params": 3_500_000_000, "trainable_share": 0.0012,
        "linear4bit": 224, "attn_implementation": "sdpa", "dtype": "torch.bfloat16", "train_rows": 3,
        "eval_rows": 0,
        **GPU_MEMORY.fields(), **LENGTHS.fields(),
    },
    "trainer_ready": {
        "phases_s": {"tokenizer": 0.4, "weights": 21.5, "lora": 1.2, "data": 0.3, "trainer": 0.8},
        "prepared": True, "prepared_s": 12.5,
    },
    "checkpoint_saved": {"step": 20, "path": "/run/checkpoints/checkpoint-20", "emergency": False,
                         "early": True},
    "resumed": {
        "from_step": 20, "path": "/run/checkpoints/checkpoint-20", "reset_optimizer": True,
        "reset_reason": "the optimizer changed", "learning_rate": 0.0002, "micro_batch_size": 2,
        "grad_accum": 8, **CUT.fields(),
    },
    "finished": {"step": 40, "adapter": "/run/adapter"},
    "merge_plan": {
        "device": "cpu", "gpu_need_bytes": 16 << 30, "host_need_gpu_bytes": 6 << 30,
        "host_need_cpu_bytes": 18 << 30, "gpu_free_bytes": None, "host_available_bytes": 64 << 30,
        "why": "no GPU visible", "dtype": "torch.bfloat16",
    },
    "script_knobs": {
        "settings": [{"knob": "micro_batch_size", "key": "per_device_train_batch_size", "asked": 16, "got": 8,
                      "where": "SFTConfig", "why_not": None},
                     {"knob": "gradient_checkpointing", "key": "use_gradient_checkpointing", "asked": True,
                      "got": True, "where": "prepare_model_for_kbit_training", "why_not": None}],
        "model_config": {"model_type": "llama", "hidden_size": 64}, "complete": True,
    },
}  # fmt: skip
MERGE_FINISHED = {"step": None, "merged": "/run/merged", "seconds": 81.5, "device": "cpu"}


def _progress_lines(tmp_path: Path) -> list[str]:
    """The lines the child's own Progress writes through its EventLog: stage, stopping,
    early_checkpoint_requested and a heartbeat."""
    path = tmp_path / "child-events.jsonl"
    log = EventLog(path)
    progress = Progress(log)
    progress.enter(Stage.LOAD)
    progress.step, progress.loss, progress.tokens_per_s = 7, 1.25, 2048.0
    log.write(progress.beat(GPU_MEMORY).to_line())
    progress.early_checkpoints = True
    progress.announce_early_checkpoints()
    progress.stop_requested = True
    progress.announce_stop()
    log.close()
    return path.read_text(encoding="utf-8").splitlines()


def _speed_trial() -> SpeedTrialEvent:
    first = TrialCandidate(4, 4, False, 2900.0, 7 << 30)
    other = TrialCandidate(2, 8, True, 2500.0, 5 << 30)
    results = (
        TrialResult(first, 3010.0, 7 << 30, 4.2),
        TrialResult(other, None, None, 1.1, "OutOfMemoryError"),
    )
    return SpeedTrialEvent(results, 5.3)


def test_every_event_the_child_writes_reads_back_as_its_record(tmp_path: Path) -> None:
    """Each event name has a record; the line the child writes parses into it with the same fields."""
    lines = [event_line(name, **fields) for name, fields in EMITTED.items()]
    lines += [event_line("finished", **MERGE_FINISHED), *_progress_lines(tmp_path)]
    lines.append(_speed_trial().to_line().rstrip("\n"))  # as run/speed_trial.py writes it
    seen: set[str] = set()
    for line in lines:
        raw = json.loads(line)
        record = parse_event(line)
        assert record is not None and record.event == raw["event"], line
        payload = {key: value for key, value in raw.items() if key not in ("event", "time")}
        written = record.fields()
        as_json = json.loads(json.dumps({k: v for k, v in written.items() if k != "event"}))
        assert as_json == payload, record.event
        assert record.time == raw["time"] and parse_event(record.to_line()) == record
        seen.add(record.event)
    assert seen == EVENT_NAMES  # a new event needs its line here too


def test_the_childs_progress_lines_keep_their_keys(tmp_path: Path) -> None:
    """stage, heartbeat, early_checkpoint_requested and stopping lines have the keys they always had."""
    lines = _progress_lines(tmp_path)
    raw = [json.loads(line) for line in lines]
    assert [(r["event"], r["stage"], r["step"]) for r in raw] == [
        ("stage", "load", 0), ("heartbeat", "load", 7), ("early_checkpoint_requested", "load", 7),
        ("stopping", "load", 7),
    ]  # fmt: skip
    assert [sorted(r) for r in raw if r["event"] != "heartbeat"] == [["event", "stage", "step", "time"]] * 3
    assert sorted(raw[1]) == sorted(
        ["event", "time", "stage", "step", "loss", "tokens_per_s", *GPU_MEMORY.fields()]
    )
    records = [parse_event(line) for line in lines]
    assert [type(r) for r in records] == [StageEntered, Heartbeat, EarlyCheckpointRequested, Stopping]


def test_typed_fields_of_the_records() -> None:
    """Nested facts come back as their own records: memory numbers, sample lengths, the rank cut."""
    loaded = parse_event(event_line("loaded", **EMITTED["loaded"]))
    assert isinstance(loaded, Loaded)
    assert loaded.sample_lengths == LENGTHS and loaded.memory == GPU_MEMORY
    assert loaded.memory.peak_source is ChildPeakSource.CUDA_ALLOCATOR
    resumed = parse_event(event_line("resumed", **EMITTED["resumed"]))
    assert isinstance(resumed, events.Resumed) and resumed.rank_reduction == CUT and resumed.from_step == 20
    beat = parse_event(Heartbeat(Stage.BACKWARD, 3, 2.5).to_line())
    assert isinstance(beat, Heartbeat) and beat.stage is Stage.BACKWARD and beat.time is not None


@pytest.mark.parametrize(
    "line",
    [
        "",
        "   ",
        '{"event": "heartb',  # torn
        "not json",
        "[1, 2]",
        '"heartbeat"',
        "{}",
        '{"event": "no_such_event", "step": 3}',  # unknown to this version
        '{"event": ["heartbeat"], "step": 3}',  # an unhashable name
        '{"event": 7}',
        '{"event": "heartbeat", "stage": "forward"}',  # no step: not a heartbeat to trust
        '{"event": "heartbeat", "step": "3"}',
        '{"event": "speed_trial", "results": "many"}',
        '{"event": "speed_trial", "results": [{"candidate": {"micro_batch_size": 1}}], "seconds": 1}',
        "[" * 100_000,  # nesting deep enough to make the decoder recurse out
    ],
)
def test_a_corrupt_or_unknown_line_gives_none(line: str) -> None:
    """A line that is no event this version knows is None, never an exception."""
    assert parse_event(line) is None


def test_a_known_event_with_a_wrong_type_is_not_trusted() -> None:
    """A known event whose values do not fit its record is None, like a torn line."""
    assert parse_event('{"event": "heartbeat", "step": 2, "loss": "low"}') is None
    assert parse_event('{"event": "checkpoint_saved", "step": 3, "path": ["a"]}') is None
    assert parse_event('{"event": "loaded", "sample_lengths": {"rows": 2, "lengths": [1, "x"]}}') is None


def test_every_stored_events_file_of_earlier_runs_parses() -> None:
    """The events files of the recorded benchmark runs (older children's lines) parse line by line
    (a bench's own trial child writes other names there, which are not ours to read)."""
    files = sorted((ROOT / "bench" / "results").rglob("child-events*.jsonl"))
    assert files, "the recorded runs hold events files"
    kinds: set[str] = set()
    for path in files:
        for line in path.read_text(encoding="utf-8").splitlines():
            if json.loads(line)["event"] not in EVENT_NAMES:
                continue
            record = parse_event(line)
            assert record is not None, (path, line[:200])
            kinds.add(record.event)
    assert {"started", "stage", "loaded", "heartbeat", "finished"} <= kinds


def test_the_reader_parses_each_line_once_and_yields_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HeartbeatReader hands out typed records, each line parsed once, and keeps them in Progress."""
    calls: list[str] = []

    def counting(line: str) -> ChildEvent | None:
        calls.append(line)
        return parse_event(line)

    monkeypatch.setattr(watch, "parse_event", counting)
    path = tmp_path / "child-events.jsonl"
    lines = [Heartbeat(Stage.FORWARD, step, 2.0, 100.0, GPU_MEMORY).to_line() for step in (1, 2, 3)]
    path.write_text("".join(lines) + event_line("finished", step=3, adapter="/a"))
    reader = HeartbeatReader(path)
    new = reader.poll(now=5.0)
    assert [type(e) for e in new] == [Heartbeat, Heartbeat, Heartbeat, events.Finished] and len(calls) == 4
    p = reader.progress
    assert p.events == new and p.finished and (p.step, p.stage, p.peak_bytes) == (3, "forward", 7 << 30)


def test_a_stage_this_version_cannot_name_is_no_progress(tmp_path: Path) -> None:
    """A newer child's stage name reads as unknown and neither moves the stage nor counts as progress."""
    path = tmp_path / "child-events.jsonl"
    path.write_text(event_line("stage", stage="forward", step=1) + event_line("stage", stage="warp", step=1))
    reader = HeartbeatReader(path)
    reader.poll(now=1.0)
    assert reader.progress.stage == "forward" and reader.progress.last_progress_at == 1.0
