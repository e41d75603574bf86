"""The journal as others read it: the policy's view of past attempts and the story of a run."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.ladder.step_up import STEP_UP_RUNG
from qlora_supervise.policies.retime import RETIME_RUNG
from qlora_supervise.supervisor.record.records import AttemptRecord, Phase
from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.spec import Knobs

#: The planned restarts to a faster config (issue 34), by the rung the journal names them with.
PLANNED_RUNGS = (STEP_UP_RUNG, RETIME_RUNG)


def policy_history(records: Sequence[AttemptRecord]) -> list[policy.PastAttempt]:
    """Every journalled attempt as the policy sees it (kind None: it did not fail; a checkpoint
    that would not load is no failure of the config)."""
    return [
        policy.PastAttempt(
            r.knobs,
            r.failure.kind if r.failure and r.failure.kind is not FailureKind.CHECKPOINT_DAMAGED else None,
            r.steps_progressed,
            r.peak.bytes if r.peak else None,
            r.failure.stage if r.failure else None,
            r.steps_completed,
            r.decision.rung if r.decision else None,
            r.unapplied,
        )
        for r in records
    ]


def story(records: Sequence[AttemptRecord]) -> list[str]:
    """One line per attempt, for the final log event."""
    lines = []
    for r in records:
        steps = f"steps {r.resumed_from}->{r.steps_completed}"
        if r.steps_progressed == 0 and r.resumed_from > 0:  # steps_completed 0: it trained none
            steps = f"resumed at {r.resumed_from}, no step trained"
        line = f"attempt {r.attempt} ({r.phase.value}): {r.outcome.value}, {steps}"
        if r.failure:
            line += f", {r.failure.kind.value} in {r.failure.stage.value}"
        if r.decision and r.restarts:
            changes = {name: list(pair) for name, pair in r.decision.changes.items()}
            line += f" -> {r.decision.rung} {changes}, lost {r.lost_steps} steps"
        lines.append(line)
    return lines


def config_text(k: Knobs) -> str:
    """A config in one line, as status and explain show it."""
    ranks = f" x ranks {k.world_size}{' (FSDP)' if k.fsdp else ''}" if k.world_size > 1 else ""
    return (
        f"micro_batch {k.micro_batch_size} x accum {k.grad_accum}{ranks}, seq_len {k.max_seq_len}, "
        f"grad_ckpt {'on' if k.gradient_checkpointing else 'off'}, {k.optimizer}, r {k.lora_r}"
    )


@dataclass(frozen=True)
class ConfigTime:
    """The wall time and the steps a run's training attempts spent in one config."""

    knobs: Knobs
    seconds: float
    steps: int

    def to_json(self) -> dict[str, Any]:
        return {"config": config_text(self.knobs), "seconds": round(self.seconds, 1), "steps": self.steps}


def time_in_configs(records: Sequence[AttemptRecord]) -> list[ConfigTime]:
    """The training attempts' time and steps per config, in the order the configs first ran."""
    seen: dict[Knobs, ConfigTime] = {}
    for r in records:
        if r.phase is not Phase.TRAIN:
            continue
        was = seen.get(r.knobs, ConfigTime(r.knobs, 0.0, 0))
        seen[r.knobs] = ConfigTime(
            r.knobs, was.seconds + r.ended_at - r.started_at, was.steps + r.steps_progressed
        )
    return list(seen.values())


def planned_restarts(records: Sequence[AttemptRecord]) -> dict[str, int]:
    """How many step-ups and re-times the run took."""
    rungs = [r.decision.rung for r in records if r.decision is not None]
    return {rung: rungs.count(rung) for rung in PLANNED_RUNGS}


def climb_back_lines(planned: dict[str, int], configs: Sequence[dict[str, Any]]) -> list[str]:
    """status and explain: the planned restarts and the time in each config, from their JSON forms;
    none without a planned restart."""
    if not any(planned.values()):
        return []
    head = (
        f"step-ups: {planned.get(STEP_UP_RUNG, 0)}, speed trials timed again: {planned.get(RETIME_RUNG, 0)}"
    )
    return [head, "time in each config:"] + [
        f"  {_clock(c['seconds'])}, {c['steps']} step(s): {c['config']}" for c in configs
    ]


def _clock(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}"
