"""Which checkpoint an attempt resumes from after a rank change, judged from the checkpoint's marker."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from qlora_supervise.policies.decide import Restart
from qlora_supervise.policies.rungs import RUNG_BY_NAME, Survives
from qlora_supervise.supervisor.loop.child_output import note_child_events
from qlora_supervise.supervisor.loop.planner import Plan, PlanFacts, next_plan
from qlora_supervise.supervisor.loop.resume import resume_point
from qlora_supervise.supervisor.record.journal import Action, AttemptRecord, DecisionRecord, Outcome, Phase
from qlora_supervise.trainer_child.contract.attempt_facts import RankReduction
from qlora_supervise.trainer_child.contract.checkpoints import CHECKPOINT_COMPLETE_MARKER
from qlora_supervise.trainer_child.contract.events import parse_event
from qlora_supervise.trainer_child.contract.spec import Knobs

KNOBS = Knobs(model="/m/7b", lora_r=16, lora_alpha=32, optimizer="paged_adamw_8bit")


def _checkpoint(root: Path, step: int, knobs: Knobs) -> Path:
    path = root / f"checkpoint-{step}"
    path.mkdir(parents=True)
    marker = {"step": step, "knobs": dataclasses.asdict(knobs), "emergency": False}
    (path / CHECKPOINT_COMPLETE_MARKER).write_text(json.dumps(marker))
    return path


def test_a_larger_rank_of_the_same_model_is_loaded_with_the_optimizer_reset(tmp_path: Path) -> None:
    """After halve_lora_rank the r 16 checkpoint is the resume point, optimizer reset, cut from rank 16."""
    path = _checkpoint(tmp_path, 6, KNOBS)
    halved = RUNG_BY_NAME["halve_lora_rank"].apply(KNOBS)
    assert halved is not None and (halved.lora_r, halved.lora_alpha) == (8, 16)
    point = resume_point(tmp_path, halved)
    assert (point.step, point.path, point.reset_optimizer, point.rank_from) == (6, path, True, 16)
    assert point.skipped == ()


def test_a_smaller_rank_or_another_model_is_skipped(tmp_path: Path) -> None:
    """A checkpoint of a smaller rank cannot grow and one of another model cannot load: both skipped."""
    _checkpoint(tmp_path, 2, KNOBS)
    _checkpoint(tmp_path, 4, dataclasses.replace(KNOBS, lora_r=8, lora_alpha=16))
    _checkpoint(tmp_path, 6, dataclasses.replace(KNOBS, model="/m/3b", lora_r=32))
    point = resume_point(tmp_path, KNOBS)
    assert (point.step, point.reset_optimizer, point.rank_from) == (2, False, None)
    assert point.skipped == (
        "checkpoint-6: adapter differs in model",
        "checkpoint-4: adapter differs in lora_r, lora_alpha",
    )


def test_the_same_rank_with_another_alpha_is_still_skipped(tmp_path: Path) -> None:
    """At the same rank nothing rescales the adapter, so another alpha is not loadable (as before)."""
    _checkpoint(tmp_path, 2, dataclasses.replace(KNOBS, lora_alpha=64))
    point = resume_point(tmp_path, KNOBS)
    assert point.path is None and point.skipped == ("checkpoint-2: adapter differs in lora_alpha",)


def test_halve_lora_rank_keeps_progress_and_the_planner_keeps_the_checkpoints() -> None:
    """The rung's tag is optimizer_reset, so its restart is no fresh start (old checkpoints stay)."""
    assert RUNG_BY_NAME["halve_lora_rank"].survives is Survives.OPTIMIZER_RESET
    halved = RUNG_BY_NAME["halve_lora_rank"].apply(KNOBS)
    assert halved is not None
    restart = Restart(halved, "halve_lora_rank", {}, "why", RUNG_BY_NAME["halve_lora_rank"].survives)
    decision = DecisionRecord.of(restart, 0.0)
    assert decision.action is Action.RESTART
    record = AttemptRecord(
        attempt=1,
        phase=Phase.TRAIN,
        knobs=KNOBS,
        outcome=Outcome.FAILED,
        started_at=0.0,
        ended_at=1.0,
        exit_code=70,
        signal=None,
        resumed_from=0,
        steps_completed=6,
        next_resume_from=6,
        lost_steps=0,
        decision=decision,
    )
    plan = next_plan([record], PlanFacts(KNOBS, merge=False, merged_exists=False))
    assert isinstance(plan, Plan) and plan.knobs == halved and plan.fresh_start is False


class _Log:
    def __init__(self) -> None:
        self.lines: list[tuple[str, dict[str, Any]]] = []

    def info(self, event: str, **fields: Any) -> None:
        self.lines.append((str(event), fields))


def test_the_supervisor_logs_rank_reduced_from_the_childs_resumed_event() -> None:
    """A resumed event with a rank reduction becomes one rank_reduced line with the energy kept."""
    reduction = RankReduction(16, 8, 128, 0.93, 0.71, "layers.3.self_attn.v_proj")
    log = _Log()
    lines = [
        {"event": "resumed", "from_step": 40},  # an ordinary resume: nothing to say
        {"event": "heartbeat", "step": 40, **reduction.fields()},  # only the resumed event counts
        {"event": "resumed", "from_step": 40, **reduction.fields()},
    ]
    note_child_events([e for e in map(parse_event, lines) if e is not None], log)
    assert log.lines == [
        (
            "rank_reduced",
            {
                **dataclasses.asdict(reduction),
                "from_step": 40,
                "why": "the smaller adapter starts from the truncated SVD of the trained update",
            },
        )
    ]
