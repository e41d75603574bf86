"""The per-host store: peaks and speeds by shape and knobs, and no line lost between two writers."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.supervisor.record.peak_store import (
    read_observations,
    read_speeds,
    record_attempt,
)
from qlora_supervise.trainer_child.contract.spec import Knobs

SHAPE = ModelShape(hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128, vocab=256)
KNOBS = Knobs(model="/m", micro_batch_size=2, grad_accum=4)
WRITER = """
import sys
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.supervisor.record.peak_store import record_attempt
from qlora_supervise.trainer_child.contract.spec import Knobs
from pathlib import Path
shape = ModelShape(hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128, vocab=256)
tag = int(sys.argv[2])
for i in range(int(sys.argv[3])):
    assert record_attempt(Path(sys.argv[1]), shape, Knobs(model=f"/m{tag}"), tag * 100000 + i, 1000.0 + i)
"""


def test_two_processes_writing_at_once_keep_every_line(tmp_path: Path) -> None:
    """Two writers racing on the store: every line of both is there (the lock serialises them)."""
    store = tmp_path / "state" / "peaks.jsonl"
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(store), str(tag), "150"]) for tag in (1, 2)
    ]
    assert [w.wait(timeout=120) for w in writers] == [0, 0]
    peaks = sorted(o.peak_bytes for o in read_observations(store, SHAPE))
    assert peaks == sorted([100000 + i for i in range(150)] + [200000 + i for i in range(150)])


def test_speeds_are_kept_by_shape_and_knobs(tmp_path: Path) -> None:
    """An attempt's tokens/s reads back for its knobs; a peak-only line is no speed and vice versa."""
    store = tmp_path / "peaks.jsonl"
    assert record_attempt(store, SHAPE, KNOBS, None, 1234.56)
    assert record_attempt(store, SHAPE, KNOBS, 4096, None)
    other = dataclasses.replace(SHAPE, layers=3)
    assert record_attempt(store, other, KNOBS, 1, 99.0)
    speeds = read_speeds(store, SHAPE)
    assert [(s.knobs, s.tokens_per_s) for s in speeds] == [(KNOBS, 1234.6)]
    assert [o.peak_bytes for o in read_observations(store, SHAPE)] == [4096]


def test_a_line_without_speed_is_a_peak_and_one_without_trainer_is_skipped(tmp_path: Path) -> None:
    """A line with no tokens_per_s is a peak and no speed; a line of the stores before the trainer
    field is skipped (they held foreign tools' peaks unlabelled: they must not calibrate ours)."""
    store = tmp_path / "peaks.jsonl"
    line = {"shape": SHAPE.sizes(), "knobs": dataclasses.asdict(KNOBS), "peak_bytes": 7, "time": 1.0}
    unlabelled = {**line, "peak_bytes": 9, "tokens_per_s": 50.0}
    rows = [json.dumps({**line, "trainer": "own"}), json.dumps(unlabelled), "torn {"]
    store.write_text("\n".join(rows) + "\n")
    assert [o.peak_bytes for o in read_observations(store, SHAPE)] == [7]
    assert read_speeds(store, SHAPE) == []
