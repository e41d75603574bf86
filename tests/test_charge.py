"""No dead ends after a rung: a new non-OOM failure after a rung changed the config is charged to the rung."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from qlora_supervise.policies.decide import GiveUp, PastAttempt, Restart, Settings, decide, unusable_rungs
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage
from qlora_supervise.trainer_child.contract.spec import Knobs


@dataclasses.dataclass(frozen=True)
class _Failure:
    kind: FailureKind
    stage: Stage = Stage.LOAD
    numbers: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    fatal_xid: int | None = None


JOB = Knobs(model="/m/8b", micro_batch_size=1, grad_accum=16, max_seq_len=2048)
HEAD = dataclasses.replace(JOB, bf16_head=True)  # what the load ladder's bf16_head rung makes of JOB
SETTINGS = Settings(fallbacks=("/m/1b",))


def _past(knobs: Knobs, kind: FailureKind | None, steps: int = 0, stage: Stage = Stage.LOAD) -> PastAttempt:
    return PastAttempt(knobs=knobs, kind=kind, steps_progressed=steps, stage=stage)


def test_a_new_error_after_a_rung_reverts_it_and_the_ladder_moves_on() -> None:
    """Load OOM -> bf16_head -> RuntimeError in load: bf16_head is reverted and unusable, and the load
    ladder's next rung (the fallback model) is taken instead of a retry of the failing config."""
    history = [_past(JOB, FailureKind.OOM_LOAD), _past(HEAD, FailureKind.OTHER)]
    out = decide(_Failure(FailureKind.OTHER), HEAD, history, SETTINGS)
    assert isinstance(out, Restart)
    assert out.knobs.model == "/m/1b" and not out.knobs.bf16_head  # reverted, then the next rung
    assert out.rung == "smaller_model"
    assert "bf16_head reverted and unusable for this run" in out.why
    assert out.changes["bf16_head"] == (True, False)


def test_a_config_error_after_a_rung_is_charged_too() -> None:
    """A config error the run never had before the change is the rung's, not a give-up."""
    history = [_past(JOB, FailureKind.OOM_LOAD), _past(HEAD, FailureKind.CONFIG_ERROR)]
    out = decide(_Failure(FailureKind.CONFIG_ERROR), HEAD, history, SETTINGS)
    assert isinstance(out, Restart) and out.knobs.model == "/m/1b"


def test_with_nothing_left_the_charge_gives_up_saying_why() -> None:
    """No rung after the charged one: give up, naming the charge (never a retry unchanged)."""
    history = [_past(JOB, FailureKind.OOM_LOAD), _past(HEAD, FailureKind.OTHER)]
    out = decide(_Failure(FailureKind.OTHER), HEAD, history, Settings())
    assert isinstance(out, GiveUp) and "bf16_head reverted" in out.why and "exhausted" in out.why


def test_a_charged_rung_stays_unusable_for_later_failures() -> None:
    """After the charge, another load OOM never takes bf16_head again."""
    fallback = dataclasses.replace(JOB, model="/m/1b")
    history = [
        _past(JOB, FailureKind.OOM_LOAD),
        _past(HEAD, FailureKind.OTHER),
        _past(fallback, FailureKind.OOM_LOAD),
    ]
    assert unusable_rungs(history) == frozenset({"bf16_head"})
    out = decide(_Failure(FailureKind.OOM_LOAD), fallback, history, Settings(fallbacks=("/m/1b", "/m/tiny")))
    assert isinstance(out, Restart) and not out.knobs.bf16_head and out.knobs.model == "/m/tiny"


def test_an_error_after_steps_trained_is_no_rungs_fault() -> None:
    """The new config trained steps before the error: transient, retried unchanged as before."""
    history = [_past(JOB, FailureKind.OOM_LOAD), _past(HEAD, FailureKind.OTHER, steps=5)]
    out = decide(_Failure(FailureKind.OTHER), HEAD, history, SETTINGS)
    assert isinstance(out, Restart) and out.rung == "retry_unchanged" and out.knobs == HEAD


def test_an_error_the_run_had_before_the_change_is_not_charged() -> None:
    """The same error happened with the old config too: the rung did not cause it."""
    history = [
        _past(JOB, FailureKind.OTHER),
        _past(JOB, FailureKind.OOM_LOAD),
        _past(HEAD, FailureKind.OTHER),
    ]
    assert unusable_rungs(history) == frozenset()
    out = decide(_Failure(FailureKind.OTHER), HEAD, history, SETTINGS)
    assert isinstance(out, Restart) and out.rung == "retry_unchanged"


def test_a_forward_rung_charged_lets_the_walk_take_the_next() -> None:
    """Forward OOM -> checkpointing -> an error at once: checkpointing is reverted and the micro-batch
    halves instead (the search never proposes checkpointing again)."""
    job = Knobs(
        model="/m/7b", micro_batch_size=4, grad_accum=4, max_seq_len=2048, gradient_checkpointing=False
    )
    ckpt = dataclasses.replace(job, gradient_checkpointing=True)
    history = [_past(job, FailureKind.OOM_FORWARD, stage=Stage.FORWARD), _past(ckpt, FailureKind.OTHER)]
    out = decide(_Failure(FailureKind.OTHER, Stage.LOAD), ckpt, history, Settings())
    assert isinstance(out, Restart) and out.rung == "halve_micro_batch"
    assert not out.knobs.gradient_checkpointing and out.knobs.micro_batch_size == 2
