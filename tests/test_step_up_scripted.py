"""Stepping back up with real processes (issue 34): the scripted child, a card whose neighbour leaves.

The bookkeeping of each cause and refusal runs on the fake clock (``test_step_up_loop.py``); this is
the one real-process run: the runner stops a live child at a checkpoint with SIGTERM, the child
checkpoints and exits, and the next process resumes in the faster config.
"""

from __future__ import annotations

import io
import time
from pathlib import Path

from run_scripted import scripted_seams
from test_loop import _events, _job

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.supervisor.watching.gpu import GpuSample
from qlora_supervise.trainer_child.contract.codes import ExitCode

GiB = 1 << 30


class NeighbourLeaves:
    """A 24 GiB card another process holds 18 GiB of for ``seconds`` of real time."""

    def __init__(self, seconds: float) -> None:
        self.until = time.monotonic() + seconds

    def sample(self, pids: set[int]) -> GpuSample:
        others = ((4242, 18 * GiB),) if time.monotonic() < self.until else ()
        used = sum(b for _, b in others)
        return GpuSample(time.time(), 0, 24 * GiB, used, 24 * GiB - used, 0, others)

    def close(self) -> None:
        pass


def test_a_live_child_is_stopped_at_a_checkpoint_and_resumed_in_the_faster_config(tmp_path: Path) -> None:
    """Contention degrades the run; once the neighbour has left for the settle time, the running
    child is stopped at its next checkpoint (exit STOPPED, no step lost) and the next process
    resumes there with the config before the rung and finishes."""
    job = _job(
        tmp_path,
        {"1": "contention@3", "2": "slow", "default": "ok"},  # slow: the neighbour leaves mid-attempt
        train={"max_steps": 16},
        degrade_on_contention=True,
        step_up_settle="1s",
    )
    seams = scripted_seams()
    card = NeighbourLeaves(2.0)
    seams.open_gpu = lambda device: card  # type: ignore[assignment,return-value]
    assert run_job(str(job), plain=True, seams=seams, console=io.StringIO(), install_signals=False) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert [r.outcome.value for r in records] == ["failed", "stepped_up", "succeeded"]
    degraded = records[1]
    assert degraded.exit_code == ExitCode.STOPPED  # the child's own graceful exit, not a kill
    assert degraded.knobs.gradient_checkpointing and not records[2].knobs.gradient_checkpointing
    assert degraded.lost_steps == 0 and records[2].resumed_from == degraded.steps_completed
    assert _events(tmp_path, "step_up")[0]["undoes_attempt"] == 1
