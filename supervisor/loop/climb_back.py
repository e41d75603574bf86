"""Climbing back: at each checkpoint of a training attempt, whether to stop it for a planned restart
in a faster config: a step-up (a rung's cause has cleared) or a re-time (the card's sharing changed
since the speed trial). Descents and past step-ups are read from the journal."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from structlog.typing import FilteringBoundLogger

from qlora_supervise.policies import choice
from qlora_supervise.policies import decide as policy
from qlora_supervise.policies.ladder import step_up as rule
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.record.journal import Action, AttemptRecord, Outcome
from qlora_supervise.supervisor.watching.watch import Progress, Watched
from qlora_supervise.trainer_child.contract.events import Heartbeat
from qlora_supervise.trainer_child.contract.spec import Knobs


@dataclass(frozen=True)
class PlannedRestart:
    """The runner's order to stop the attempt at this checkpoint: to ``knobs``, for ``why``."""

    knobs: Knobs
    rung: str  # rule.STEP_UP_RUNG or choice.RETIME_RUNG
    why: str
    changes: dict[str, tuple[object, object]] = field(default_factory=dict)
    undoes: int | None = None  # a step-up: the attempt whose rung it undoes


def descents(records: Sequence[AttemptRecord], data_lengths: Sequence[int]) -> list[rule.Descent]:
    """Every rung the journal's restarts took for a cause a step-up can undo, oldest first."""
    found = []
    for r in records:
        d, f = r.decision, r.failure
        if d is None or f is None or d.action is not Action.RESTART or d.knobs is None or d.knobs == r.knobs:
            continue
        lengths = [int(n) for n in f.numbers.get("batch_lengths") or ()]
        if (cause := rule.cause_of(f.kind, policy.SPURIOUS_KEY in f.numbers, lengths, data_lengths)) is None:
            continue
        batch_step = f.numbers.get("batch_step")
        failed_step = int(batch_step) if isinstance(batch_step, int) else r.steps_completed + 1
        others = f.numbers.get("others_in_use")
        found.append(
            rule.Descent(
                r.attempt, cause, f.kind, f.evidence, r.knobs, d.knobs, failed_step,
                r.peak.bytes if r.peak else None, int(others) if isinstance(others, int) else None,
            )
        )  # fmt: skip
    return found


def past_step_ups(records: Sequence[AttemptRecord]) -> list[rule.PastStepUp]:
    """The journal's step-ups, each with whether the attempt that ran its config failed."""
    found = []
    for r, after in zip(records, [*records[1:], None], strict=False):
        if (d := r.decision) is None or d.rung != rule.STEP_UP_RUNG or d.knobs is None or d.undoes is None:
            continue
        failed = after is not None and after.outcome is Outcome.FAILED and after.failure is not None
        found.append(rule.PastStepUp(d.undoes, d.knobs, failed))
    return found


def remaining_s(progress: Progress, knobs: Knobs) -> float:
    """The training time left at the attempt's measured seconds per step; inf: unknown. Without two
    timed heartbeats at different steps, the full-length tokens estimate (an upper bound): real rows
    are usually far shorter than ``max_seq_len``."""
    if not progress.max_steps:
        return math.inf
    left = max(0, progress.max_steps - progress.step)
    beats = [e for e in progress.events if isinstance(e, Heartbeat) and e.time is not None]
    # From the first beat after a step finished: the ones before it include the load and setup.
    beats = [b for b in beats if b.step > beats[0].step] if beats else []
    if len(beats) >= 2 and beats[-1].step > beats[0].step:
        return left * ((beats[-1].time or 0.0) - (beats[0].time or 0.0)) / (beats[-1].step - beats[0].step)
    if not progress.tokens_per_s:
        return math.inf
    tokens_per_step = knobs.micro_batch_size * knobs.grad_accum * knobs.world_size * knobs.max_seq_len
    return left * tokens_per_step / progress.tokens_per_s


@dataclass
class ClimbBack:
    """One run's watch for a faster config; ``records`` is the arbiter's journal list, kept current."""

    records: list[AttemptRecord]
    settings: Callable[[], policy.Settings]
    first_trial: choice.Trial | None
    log: FilteringBoundLogger
    # (time, the others, card total) of each NVML sample
    samples: list[tuple[float, choice.Sharing, int | None]] = field(default_factory=list)
    said: set[str] = field(default_factory=set)
    trial_at: tuple[float, choice.Sharing | None] | None = None  # this attempt's trial: when, others

    def start(self) -> None:
        """A new attempt: the card's story starts again."""
        self.samples.clear()
        self.trial_at = None

    def sample(self, now: float, watched: Watched) -> None:
        """The newest NVML sample of the attempt (its others' memory and SM utilisation)."""
        if watched.gpu_others_at_end is not None:
            sharing = choice.Sharing(watched.gpu_others_at_end, watched.gpu_others_sm_util)
            self.samples.append((now, sharing, watched.gpu_total))

    def trial_seen(self, now: float) -> None:
        """The attempt's speed trial ended now: the sharing it was timed beside."""
        self.trial_at = (now, self.samples[-1][1] if self.samples else None)

    def at_checkpoint(
        self, knobs: Knobs, step: int, now: float, remaining_s: float = math.inf
    ) -> PlannedRestart | None:
        """The planned restart to take at this checkpoint of an attempt running ``knobs``, or None."""
        settings = self.settings()
        lengths = settings.sample_lengths.lengths if settings.sample_lengths else ()
        # The card now: the others' most over the last settle time (the level they stayed at or below).
        settle, samples, card = settings.step_up_settle_s, self.samples, rule.CardNow(step, None, None, 0.0)
        recent = [s for s in samples if s[0] >= now - settle]
        if samples:
            held = max(s[1].others_bytes for s in (recent or samples[-1:]))
            card = rule.CardNow(step, samples[-1][2], held, min(settle, now - samples[0][0]))
        past = descents(self.records, lengths), past_step_ups(self.records)
        answer = rule.step_up(knobs, *past, settings, card)
        if isinstance(answer, rule.StepUp):
            return PlannedRestart(
                answer.knobs, rule.STEP_UP_RUNG, answer.why, answer.changes, answer.descent.attempt
            )
        if isinstance(answer, rule.Refusal):
            # Once per descent and reason (its numbers move with the card's every sample).
            key = f"{answer.descent.attempt}:{re.sub(r'[0-9.]+', '#', answer.why)}"
            if key not in self.said:
                self.said.add(key)
                self.log.info(Event.STEP_UP_REFUSED, undoes=answer.descent.attempt, why=answer.why)
        if self.trial_at is None or self.first_trial is None or not settings.step_up:
            return None
        when, then = self.trial_at
        held_for = now - max(when, samples[0][0]) if samples else 0.0
        window = [s[1] for s in recent]
        retimed = choice.retime(self.first_trial, knobs, then, window, held_for, settle, remaining_s)
        if retimed is None:
            return None
        self.trial_at = None  # once per trial
        to, why = retimed
        pairs = {n: (getattr(knobs, n), getattr(to, n)) for n in choice.TRIAL_KNOBS}
        changes: dict[str, tuple[object, object]] = {n: p for n, p in pairs.items() if p[0] != p[1]}
        return PlannedRestart(to, choice.RETIME_RUNG, why, changes)
