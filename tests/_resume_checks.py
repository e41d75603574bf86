"""What a resume after an OOM at step 2 must keep, checked the same way for every trainer (tests only).

The run under test: 3 steps of 16 samples, an OOM in step 2 at micro-batch 16 x 1, the restart
at 8 x 2 from the step-1 checkpoint, ``QLORA_SUPERVISE_TEST_TRACE_BATCHES`` writing each
micro-batch the Trainer trained.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def assert_same_samples_per_step(trace: Path) -> None:
    """Step 2 after the resume trains exactly the 16 samples it began with before the OOM, in two
    micro-batches of 8; no sample of the 3 steps is seen twice."""
    batches = read_lines(trace)
    before = next(b for b in batches if b["step"] == 2 and len(b["rows"]) == 16)
    after = batches[batches.index(before) + 1 :]
    assert [(b["step"], len(b["rows"])) for b in after] == [(2, 8), (2, 8), (3, 8), (3, 8)]
    assert Counter(r for b in after if b["step"] == 2 for r in b["rows"]) == Counter(before["rows"])
    trained = [r for b in batches if b is not before for r in b["rows"]]
    assert len(trained) == len(set(trained)) == 48


def assert_loss_continues(run: Path, rel: float = 1e-4) -> None:
    """The tool's own history after the resume runs 1, 2 with no step repeated, step 1's loss is
    the one attempt 1 logged (to ``rel``: a tool may round what it logs), and no later step jumps
    the way a restart from step 0 would."""
    state = json.loads((run / "checkpoints" / "checkpoint-2" / "trainer_state.json").read_text())
    losses = {h["step"]: float(h["loss"]) for h in state["log_history"] if "loss" in h}
    assert sorted(losses) == [1, 2]
    beats = _heartbeats(run / "attempt-001" / "child-events.jsonl")
    assert any(b.get("step") == 1 and b.get("loss") == pytest.approx(losses[1], rel=rel) for b in beats)
    later = _heartbeats(run / "attempt-002" / "child-events.jsonl")
    losses[3] = next(b["loss"] for b in later if b.get("step") == 3 and b.get("loss") is not None)
    assert all(abs(losses[s] - losses[1]) < 0.25 * losses[1] for s in (2, 3))


def _heartbeats(events: Path) -> list[dict[str, Any]]:
    return [e for e in read_lines(events) if e.get("event") == "heartbeat"]
