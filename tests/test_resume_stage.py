"""The stage ``resume`` (issue 33): the checkpoint's state loaded before the first resumed step.

Its classification from the child's stage and from text, its ladder (the optimizer state through
the host, the paged 8-bit optimizer, a fresh optimizer state with the LR schedule kept), the resume
point that carries the last rung out, and a real child on the CPU whose optimizer-state load runs
out of memory (an injected cap, named as such) and which then resumes with a fresh state.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from _child import events, log_tail, make_spec, next_spec, report, run_child

from qlora_supervise.policies.decide import GiveUp, PastAttempt, Restart, Settings, decide
from qlora_supervise.policies.rungs import RUNG_BY_NAME, Survives, ladder_for
from qlora_supervise.supervisor.diagnosis.classify import classify_exit
from qlora_supervise.supervisor.facts.failure import ChildExit
from qlora_supervise.supervisor.loop.resume import resume_point
from qlora_supervise.trainer_child.contract.checkpoints import CHECKPOINT_COMPLETE_MARKER
from qlora_supervise.trainer_child.contract.codes import ExitCode, FailureKind, Stage
from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import Knobs

TEST_CAP_IN_RESUME = "QLORA_SUPERVISE_TEST_CAP_IN_RESUME"
ADAMW = Knobs(model="/m/7b", optimizer="adamw_torch")


@dataclasses.dataclass(frozen=True)
class _Failure:
    kind: FailureKind = FailureKind.OOM_RESUME
    stage: Stage = Stage.RESUME
    numbers: dict[str, int] = dataclasses.field(default_factory=dict)
    fatal_xid: int | None = None


def _walk(knobs: Knobs) -> list[str]:
    """The rungs the resume ladder takes from ``knobs``, one failed attempt after another."""
    history: list[PastAttempt] = []
    taken = []
    while True:
        history.append(PastAttempt(knobs, FailureKind.OOM_RESUME, 0, stage=Stage.RESUME))
        decision = decide(_Failure(), knobs, history, Settings(max_attempts=10, max_no_progress=10))
        if not isinstance(decision, Restart):
            assert isinstance(decision, GiveUp) and "exhausted" in decision.why
            return taken
        taken.append(decision.rung)
        knobs = decision.knobs


def test_the_resume_ladder_is_host_then_a_fresh_state_then_paged() -> None:
    """Under torchrun the ladder reads the state through the host, then starts it afresh, then pages
    it: a changed optimizer throws the saved moments away too, so the fresh state costs less."""
    assert ladder_for(FailureKind.OOM_RESUME, Stage.RESUME) == (
        "optimizer_state_on_host",
        "fresh_optimizer_state",
        "paged_8bit_optimizer",
    )
    two_ranks = dataclasses.replace(ADAMW, world_size=2, grad_accum=8)
    assert _walk(two_ranks) == ["optimizer_state_on_host", "fresh_optimizer_state", "paged_8bit_optimizer"]


def test_one_process_skips_the_host_rung_transformers_already_takes() -> None:
    """On one process transformers already reads the state with map_location cpu: nothing to change."""
    assert RUNG_BY_NAME["optimizer_state_on_host"].apply(ADAMW) is None
    assert _walk(ADAMW) == ["fresh_optimizer_state", "paged_8bit_optimizer"]
    assert _walk(dataclasses.replace(ADAMW, optimizer="paged_adamw_8bit")) == ["fresh_optimizer_state"]


def test_the_fresh_state_keeps_adapter_and_step_and_says_so() -> None:
    """The fresh optimizer state is journalled as progress that survives: the adapter and the step."""
    rung = RUNG_BY_NAME["fresh_optimizer_state"]
    assert rung.survives is Survives.OPTIMIZER_RESET
    assert "LR schedule kept" in rung.reason


def _checkpoint(directory: Path, step: int, knobs: Knobs) -> Path:
    path = directory / f"checkpoint-{step}"
    path.mkdir(parents=True)
    marker = {"step": step, "knobs": dataclasses.asdict(knobs)}
    (path / CHECKPOINT_COMPLETE_MARKER).write_text(json.dumps(marker))
    return path


def test_a_checkpoint_from_before_the_fresh_state_rung_resumes_without_its_optimizer(tmp_path: Path) -> None:
    """The rung resets the state of a checkpoint written before it, not of one written after it."""
    before = dataclasses.replace(ADAMW, optimizer="paged_adamw_8bit")
    after = dataclasses.replace(before, fresh_optimizer_state=True)
    _checkpoint(tmp_path, 10, before)
    assert resume_point(tmp_path, after).reset_optimizer
    assert not resume_point(tmp_path, before).reset_optimizer
    _checkpoint(tmp_path, 20, after)
    point = resume_point(tmp_path, after)
    assert (point.step, point.reset_optimizer) == (20, False)


def test_a_report_in_the_resume_stage_is_oom_resume() -> None:
    """The child's report says resume: the failure is oom_resume, whatever the frames inside say."""
    report = ErrorReport(
        exit_code=int(ExitCode.OOM), exception_type="torch.OutOfMemoryError",
        message="CUDA out of memory. Tried to allocate 256.00 MiB.", traceback="", stage="resume",
        step=40, is_oom=True, device="cuda:0",
    )  # fmt: skip
    found = classify_exit(ChildExit(returncode=int(ExitCode.OOM)), report, "")
    assert (found.kind, found.stage) == (FailureKind.OOM_RESUME, Stage.RESUME)


@pytest.mark.slow
def test_a_real_resume_that_runs_out_loading_its_optimizer_state_resumes_with_a_fresh_one(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """A real child OOMs reading its optimizer state (injected cap): oom_resume, then a fresh state."""
    first = make_spec(tiny_dir, tmp_path / "run", train={"max_steps": 4, "save_steps": 2})
    assert run_child(first) == ExitCode.OK, log_tail(first)
    checkpoints = Path(first.checkpoints_dir)
    shutil.rmtree(checkpoints / "checkpoint-4")  # resume from step 2, two steps still to train
    start = resume_point(checkpoints, first.knobs)
    assert start.step == 2 and start.path is not None and not start.reset_optimizer

    second = next_spec(first, resume_from=str(start.path))
    code = run_child(second, **{TEST_CAP_IN_RESUME: "1"})
    failed = report(second)
    assert code == ExitCode.OOM and failed.stage is Stage.RESUME and failed.is_oom, log_tail(second)
    assert not failed.emergency_checkpoint  # a half-loaded optimizer state is never saved
    failure = classify_exit(ChildExit(returncode=code), failed, log_tail(second))
    assert failure.kind is FailureKind.OOM_RESUME, failure.evidence

    history = [PastAttempt(second.knobs, failure.kind, 0, stage=failure.stage)]
    decision = decide(failure, second.knobs, history, Settings())
    assert isinstance(decision, Restart) and decision.rung == "fresh_optimizer_state", decision
    again = resume_point(checkpoints, decision.knobs)
    assert again.step == 2 and again.reset_optimizer
    third = next_spec(
        second, knobs={"fresh_optimizer_state": True}, resume_from=str(again.path), reset_optimizer=True
    )
    assert run_child(third, **{TEST_CAP_IN_RESUME: "1"}) == ExitCode.OK, log_tail(third)
    resumed = next(e for e in events(third) if e["event"] == "resumed")
    assert resumed["from_step"] == 2 and resumed["reset_optimizer"] is True
    # cosine over 4 steps without warmup, at step 2: half the peak, not a schedule started again
    assert resumed["learning_rate"] == pytest.approx(first.train.learning_rate / 2)
    assert next(e for e in events(third) if e["event"] == "finished")["step"] == 4
