"""What quality rungs cost on the real trainer: the rank cut by SVD on resume, the lengths seq_len cuts."""

from __future__ import annotations

import dataclasses
import json
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from _child import events, log_tail, make_spec, next_spec, run_child

from qlora_supervise.trainer_child.contract.codes import ExitCode
from qlora_supervise.trainer_child.contract.events import Loaded, Resumed, parse_event
from qlora_supervise.trainer_child.contract.spec import AttemptSpec

pytestmark = pytest.mark.slow
TRACE = "QLORA_SUPERVISE_TEST_TRACE_BATCHES"
#: Five steps with a checkpoint after the fourth; the schedule is the same in every run.
TRAIN = {"max_steps": 5, "save_steps": 4, "learning_rate": 5e-3}


def loss_at(spec: AttemptSpec, step: int) -> float:
    """The training loss of optimizer step ``step``: computed with the weights of step - 1."""
    losses = [
        e["loss"] for e in events(spec) if e["event"] == "heartbeat" and e["step"] == step and e["loss"]
    ]
    assert losses, log_tail(spec)
    return float(losses[0])


def rows_of_step(trace: Path, step: int) -> list[str]:
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    return sorted(row for record in records if record["step"] == step for row in record["rows"])


def safetensors_shapes(path: Path) -> dict[str, Any]:
    """Tensor shapes from a safetensors header (8-byte length, then JSON), without torch."""
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {name: entry["shape"] for name, entry in header.items() if name != "__metadata__"}


@dataclass(frozen=True)
class Trained:
    spec: AttemptSpec
    trace: Path


@pytest.fixture(scope="module", name="r8")
def r8_fixture(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """Five steps at r 8 (checkpoints 4 and 5), with every micro-batch traced; shared by the tests."""
    root = tmp_path_factory.mktemp("r8")
    first = make_spec(tiny_dir, root / "run", knobs={"lora_r": 8, "lora_alpha": 16}, train=TRAIN)
    assert run_child(first, **{TRACE: str(root / "first.jsonl")}) == ExitCode.OK, log_tail(first)
    return Trained(first, root / "first.jsonl")


def test_loaded_reports_the_untruncated_lengths_trl_trains_on(r8: Trained) -> None:
    """The loaded event holds every sample's length; each traced row is one of them cut at max_seq_len."""
    loaded = next(e for e in events(r8.spec) if e["event"] == "loaded")
    record = parse_event(loaded)
    lengths = record.sample_lengths if isinstance(record, Loaded) else None
    assert lengths is not None and lengths.exact and lengths.rows == loaded["train_rows"] == 320
    cap = r8.spec.knobs.max_seq_len
    assert (
        max(lengths.lengths) > cap
    )  # some rows are cut at this length: the lengths are the untruncated ones
    records = [json.loads(line) for line in r8.trace.read_text().splitlines()]
    traced = Counter(sum(label != -100 for label in row) for r in records for row in r["labels"])
    assert sum(traced.values()) == 5 * 8
    assert not traced - Counter(min(length, cap) for length in lengths.lengths), traced


def test_rank_halved_on_resume_keeps_step_data_position_and_loss(
    r8: Trained, tiny_dir: Path, tmp_path: Path
) -> None:
    """r 8 -> r 4 on resume: energy reported, same step and rows, rank 4 saved, loss near the r 8 loss."""
    first = r8.spec
    checkpoint = Path(first.checkpoints_dir) / "checkpoint-4"

    second = next_spec(first, knobs={"lora_r": 4, "lora_alpha": 8}, resume_from=str(checkpoint))
    second = dataclasses.replace(second, adapter_dir=str(tmp_path / "adapter"))
    assert run_child(second, **{TRACE: str(tmp_path / "second.jsonl")}) == ExitCode.OK, log_tail(second)

    # A fresh adapter (B = 0, so delta W = 0) on the same batches: the loss with nothing learnt.
    fresh = make_spec(
        tiny_dir,
        tmp_path / "fresh",
        knobs={"lora_r": 4, "lora_alpha": 8},
        train={**TRAIN, "learning_rate": 0.0},
    )
    assert run_child(fresh) == ExitCode.OK, log_tail(fresh)

    resumed = next(e for e in events(second) if e["event"] == "resumed")
    assert resumed["from_step"] == 4 and resumed["reset_optimizer"] is True
    record = parse_event(resumed)
    reduction = record.rank_reduction if isinstance(record, Resumed) else None
    assert reduction is not None, resumed
    assert (reduction.rank_from, reduction.rank_to, reduction.modules) == (8, 4, 16)
    assert 0.3 < reduction.worst_energy_kept <= reduction.energy_kept < 1.0
    assert rows_of_step(tmp_path / "second.jsonl", 5) == rows_of_step(r8.trace, 5)
    assert next(e for e in events(second) if e["event"] == "finished")["step"] == 5

    config = json.loads((Path(second.adapter_dir) / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    shapes = safetensors_shapes(Path(second.adapter_dir) / "adapter_model.safetensors")
    assert shapes and all((s[0] if ".lora_A." in k else s[1]) == 4 for k, s in shapes.items())

    before, after, nothing_learnt = loss_at(first, 5), loss_at(second, 5), loss_at(fresh, 5)
    assert nothing_learnt - before > 0.3, (before, nothing_learnt)  # four steps did learn something
    assert abs(after - before) < 0.25 * (nothing_learnt - before), (before, after, nothing_learnt)
