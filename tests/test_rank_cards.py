"""NVML per rank under torchrun, with a fake NVML: each rank's card watched, the failing card named,
and the card ``drop_rank`` left out no longer watched."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
from test_gpu import GIB, FakeNvml, _Proc

from qlora_supervise.policies.rungs import RungContext, rung_by_name
from qlora_supervise.supervisor.facts.failure import ChildExit, Failure
from qlora_supervise.supervisor.loop.outcome import AttemptOutcome, judge
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.record.journal import Phase
from qlora_supervise.supervisor.watching.gpu import RankCards
from qlora_supervise.supervisor.watching.watch import Progress, Watched, sample_cards
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.spec import Knobs

TWO = Knobs(model="m", micro_batch_size=2, grad_accum=4, world_size=2)


@dataclass
class PerCardNvml(FakeNvml):
    """A fake NVML whose four cards each hold their own processes (``FakeNvml`` shows one list on all)."""

    on_card: dict[int, list[_Proc]] | None = None
    opened: list[int] | None = None

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        self.opened = [*(self.opened or []), index]
        return super().nvmlDeviceGetHandleByIndex(index)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[_Proc]:
        return (self.on_card or {}).get(handle, [])

    def nvmlDeviceGetGraphicsRunningProcesses(self, handle: int) -> list[_Proc]:
        return []


def test_each_rank_is_watched_on_its_own_card_through_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Local rank N is watched on the N-th card the child sees ("2,3,0": ranks 0, 1 on GPUs 2, 3)."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,0")
    cards = RankCards.open(TWO, "auto", nvml=PerCardNvml())
    assert cards is not None and cards.indexes == {0: 2, 1: 3}
    # drop_rank left position 1 out of three ranks: the two left train on positions 0 and 2.
    dropped = RankCards.open(Knobs(model="m", world_size=2, gpus="0,2"), "auto", nvml=PerCardNvml())
    assert dropped is not None and dropped.indexes == {0: 2, 1: 0}
    assert RankCards.open(TWO, "cpu", nvml=PerCardNvml()) is None
    assert RankCards.open(Knobs(model="m"), "auto", nvml=PerCardNvml()) is None  # the job's one card


def test_after_drop_rank_the_dropped_card_is_no_longer_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 0's card failing: drop_rank leaves one process on visible position 1, the only card opened."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    failed_card_0 = RungContext(failed_local_rank=0)
    after = rung_by_name("drop_rank", failed_card_0).step(TWO, failed_card_0)
    assert after is not None and (after.world_size, after.gpus, after.effective_batch) == (1, "1", 16)
    nvml = PerCardNvml()
    cards = RankCards.open(after, "auto", nvml=nvml)
    assert cards is not None and cards.indexes == {0: 1}
    assert nvml.opened == [1]  # card 0 is not touched


def test_every_cards_sample_is_logged_and_the_attempts_peak_is_the_highest_card(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpu.jsonl gets one line per card with its local rank; the peak is the card that limits the config."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    tree = {100, 101}
    monkeypatch.setattr("qlora_supervise.supervisor.watching.watch.pid_tree", lambda pid: tree)
    nvml = PerCardNvml(on_card={2: [_Proc(100, 10 * GIB)], 3: [_Proc(101, 12 * GIB), _Proc(900, 3 * GIB)]})
    cards = RankCards.open(TWO, "auto", nvml=nvml)
    assert cards is not None
    watched, log = Watched(Progress()), tmp_path / "gpu.jsonl"
    sample_cards(100, watched, cards, log)
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(line["local_rank"], line["gpu"], line["this_process_bytes"]) for line in lines] == [
        (0, 2, 10 * GIB),
        (1, 3, 12 * GIB),
    ]
    assert watched.card_peaks == {0: 10 * GIB, 1: 12 * GIB} and watched.gpu_peak_process == 12 * GIB
    assert watched.gpu_others_at_end == 3 * GIB and watched.cards == {0: 2, 1: 3}
    cards.close()
    assert nvml.calls.count("shutdown") == 2  # each card's NVML handle released


def test_a_fatal_xid_on_one_card_names_that_rank_so_drop_rank_leaves_its_card_out() -> None:
    """No rank reported (killed by the fault): the card NVML saw Xid 79 on is the failing rank and GPU."""
    outcome = AttemptOutcome(
        number=1, plan=Plan(Phase.TRAIN, TWO), exit=ChildExit(1, None, None, 3.0), progress=Progress(step=2),
        report=None, memory=Watched(Progress(), xid_events=[79], cards={0: 2, 1: 3}, card_xids={0: [79]}),
        resumed_from=0, started_at=0.0, ended_at=1.0, log_tail="",
    )  # fmt: skip
    failure = judge(outcome, phase_done=False)
    assert isinstance(failure, Failure) and failure.kind is FailureKind.GPU_FAULT
    assert (failure.local_rank, failure.gpu) == (0, 2)
    assert "Xid 79 on local rank 0's card" in failure.evidence and "GPU 2" in failure.evidence
    assert Failure.from_json(failure.to_json()).gpu == 2
    context = RungContext(failed_local_rank=failure.local_rank)
    after = rung_by_name("drop_rank", context).step(TWO, context)
    assert after is not None and after.gpus == "1"
