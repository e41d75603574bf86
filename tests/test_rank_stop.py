"""The ranks' stop decision (``torchrun.decide_together``) over a real gloo process group.

The race it guards: torchrun forwards SIGTERM to every rank at nearly the same moment, and a
rank spends much of a step's end blocked in the all-reduce of the flags. Python runs the signal
handler only when that call returns, after this rank's value was sent, so no rank saw the signal
in this step's vote. Here the handler is run at exactly that point, by wrapping the all-reduce.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from qlora_supervise.trainer_child.run import torchrun
from qlora_supervise.trainer_child.run.heartbeat import EventLog, Progress

# torch.distributed is imported by the tests that run, not at collection: every xdist worker
# collects every module.

#: Two ranks as the child sees them; the group itself has one member (the vote is the same MAX).
TWO_RANKS = torchrun.RankPlace(rank=0, local_rank=0, world_size=2)


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def progress(tmp_path: Path) -> Iterator[Progress]:
    """A rank's progress; its events file is closed after the test (an open one left to the
    garbage collector closes at a random later moment, under another test's descriptor count)."""
    events = EventLog(tmp_path / "events.jsonl")
    yield Progress(events)
    events.close()


def _signal_during_all_reduce(monkeypatch: pytest.MonkeyPatch, progress: Progress, flag: str) -> list[int]:
    """Wrap the all-reduce so that ``flag`` is raised as it returns, once; counts the calls."""
    import torch.distributed as dist

    real = dist.all_reduce
    calls: list[int] = []

    def all_reduce(tensor: Any, *args: Any, **kwargs: Any) -> Any:
        result = real(tensor, *args, **kwargs)
        if not calls:
            setattr(progress, flag, True)  # the handler, run as the collective returns
        calls.append(1)
        return result

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    return calls


def test_a_sigterm_during_the_vote_stops_every_rank_at_the_next_step(
    group: None, progress: Progress, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A signal that lands inside the all-reduce is kept, and every rank stops one step later."""
    calls = _signal_during_all_reduce(monkeypatch, progress, "stop_requested")
    # This step's vote did not carry the signal: no rank may stop alone on it.
    assert torchrun.decide_together(TWO_RANKS, progress, "cpu") == (False, False)
    assert progress.stop_requested  # ...but the signal is kept, not overwritten by the vote
    # The next step's vote carries it, so all ranks stop after the same step.
    assert torchrun.decide_together(TWO_RANKS, progress, "cpu") == (True, False)
    assert len(calls) == 2


def test_the_early_checkpoint_signal_during_the_vote_is_kept_too(
    group: None, progress: Progress, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory-creep signal has the same race and the same fix."""
    _signal_during_all_reduce(monkeypatch, progress, "early_checkpoints")
    assert torchrun.decide_together(TWO_RANKS, progress, "cpu") == (False, False)
    assert torchrun.decide_together(TWO_RANKS, progress, "cpu") == (False, True)
    assert not progress.stop_requested


def test_a_flag_raised_before_the_vote_acts_in_the_same_step(group: None, progress: Progress) -> None:
    """A signal seen before the vote stops the ranks after this very step."""
    progress.stop_requested = True
    assert torchrun.decide_together(TWO_RANKS, progress, "cpu") == (True, False)


def test_one_process_decides_from_its_own_flags_without_a_group(progress: Progress) -> None:
    """A single process has no vote: its own flags are the decision."""
    assert torchrun.decide_together(torchrun.SINGLE, progress, "cpu") == (False, False)
    progress.early_checkpoints = True
    assert torchrun.decide_together(torchrun.SINGLE, progress, "cpu") == (False, True)
