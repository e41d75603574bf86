"""The emergency checkpoint under torchrun: the ranks' parts sealed into one checkpoint when every
rank's part names the same step, and none trusted otherwise."""

from __future__ import annotations

import json
from pathlib import Path

import structlog

from qlora_supervise.supervisor.loop.child_output import seal_rank_parts
from qlora_supervise.trainer_child.contract.checkpoints import PART_DONE, is_complete, part_dir
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import Knobs

TWO = Knobs(model="m", world_size=2, micro_batch_size=2, grad_accum=4)
LAUNCHER = 4242


def _part(checkpoints: Path, rank: int, step: int, done: bool = True) -> ErrorReport:
    """Rank ``rank``'s part of ``step`` as save_rank_part leaves it, and its report naming it."""
    part = part_dir(checkpoints, step, LAUNCHER, rank)
    part.mkdir(parents=True)
    (part / f"rng_state_{rank}.pth").write_bytes(b"rng%d" % rank)
    if rank == 0:
        (part / "adapter_model.safetensors").write_bytes(b"adapter")
        (part / "optimizer.pt").write_bytes(b"moments")
    if done:
        (part / PART_DONE).write_text(json.dumps({"step": step, "rank": rank, "world_size": 2}))
    return ErrorReport(
        exit_code=3, exception_type="E", message="m", traceback="t", stage="forward", step=step + 1,
        is_oom=rank == 1, emergency_checkpoint=str(part), emergency_step=step, rank=rank, local_rank=rank,
        world_size=2,
    )  # fmt: skip


def test_parts_of_one_step_from_every_rank_become_one_checkpoint(tmp_path: Path) -> None:
    """Rank 0's state and both ranks' RNG files are sealed as checkpoint-5; the reports name it."""
    reports = seal_rank_parts(
        tmp_path, [_part(tmp_path, 0, 5), _part(tmp_path, 1, 5)], TWO, structlog.get_logger()
    )
    final = tmp_path / "checkpoint-5"
    assert is_complete(final)
    marker = json.loads((final / "qlora_supervise_complete.json").read_text())
    assert marker["emergency"] and marker["step"] == 5
    assert {"rng_state_0.pth", "rng_state_1.pth", "optimizer.pt", "adapter_model.safetensors"} <= set(
        marker["files"]
    )
    assert {r.emergency_checkpoint for r in reports} == {str(final)} and {
        r.emergency_step for r in reports
    } == {5}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint-5"]  # the parts' directory is gone


def test_parts_that_disagree_or_are_missing_are_not_trusted(tmp_path: Path) -> None:
    """Different steps, an unfinished part, or one rank's part alone: no checkpoint, reports name none."""
    for name, reports in (
        ("steps", [_part(tmp_path / "steps", 0, 5), _part(tmp_path / "steps", 1, 6)]),
        (
            "unfinished",
            [_part(tmp_path / "unfinished", 0, 5), _part(tmp_path / "unfinished", 1, 5, done=False)],
        ),
        ("alone", [_part(tmp_path / "alone", 1, 5)]),
    ):
        sealed = seal_rank_parts(tmp_path / name, reports, TWO, structlog.get_logger())
        assert not list((tmp_path / name).glob("checkpoint-*")), name
        assert all(r.emergency_checkpoint is None and r.emergency_step is None for r in sealed), name
        assert not list((tmp_path / name).iterdir()), name  # untrusted parts are not kept
