"""The real trainer resumes an r 8 checkpoint at r 4 from the truncated SVD, at the same step and loss."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest
from _child import events, log_tail, make_spec, next_spec, run_child

from qlora_supervise.trainer_child.attempt_facts import RankReduction
from qlora_supervise.trainer_child.protocol import AttemptSpec, ExitCode

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


def test_rank_halved_on_resume_keeps_step_data_position_and_loss(tiny_dir: Path, tmp_path: Path) -> None:
    """r 8 -> r 4 on resume: energy reported, same step and rows, rank 4 saved, loss near the r 8 loss."""
    first = make_spec(tiny_dir, tmp_path / "run", knobs={"lora_r": 8, "lora_alpha": 16}, train=TRAIN)
    assert run_child(first, **{TRACE: str(tmp_path / "first.jsonl")}) == ExitCode.OK, log_tail(first)
    checkpoint = Path(first.checkpoints_dir) / "checkpoint-4"

    second = next_spec(first, knobs={"lora_r": 4, "lora_alpha": 8}, resume_from=str(checkpoint))
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
    reduction = RankReduction.from_fields(resumed)
    assert reduction is not None, resumed
    assert (reduction.rank_from, reduction.rank_to, reduction.modules) == (8, 4, 16)
    assert 0.3 < reduction.worst_energy_kept <= reduction.energy_kept < 1.0
    assert rows_of_step(tmp_path / "second.jsonl", 5) == rows_of_step(tmp_path / "first.jsonl", 5)
    assert next(e for e in events(second) if e["event"] == "finished")["step"] == 5

    config = json.loads((Path(second.adapter_dir) / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    shapes = safetensors_shapes(Path(second.adapter_dir) / "adapter_model.safetensors")
    assert shapes and all((s[0] if ".lora_A." in k else s[1]) == 4 for k, s in shapes.items())

    before, after, nothing_learnt = loss_at(first, 5), loss_at(second, 5), loss_at(fresh, 5)
    assert nothing_learnt - before > 0.3, (before, nothing_learnt)  # four steps did learn something
    assert abs(after - before) < 0.25 * (nothing_learnt - before), (before, after, nothing_learnt)
