"""No dead end after a rung, with the real trainer: a rung whose config the stack cannot run is charged.

The real child on the tiny model under a real CPU memory cap runs out of memory in forward; the
ladder turns gradient checkpointing on; the child then fails at load with a plain RuntimeError
(the injected fault ``QLORA_SUPERVISE_TEST_FAIL_WITH_KNOB``, standing in for the 4-bit CPU-offload
crash that a real GPU showed: "Tensor.item() cannot be called on meta tensors"). The policy must
charge the error to the rung, revert it, never retry that config, and go on down the ladder.
"""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from _child import capped_job

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.loop.child import Seams
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.trainer_child.recipe.qlora import TEST_FAIL_WITH_KNOB

pytestmark = pytest.mark.slow  # module-wide: under -m "not slow" conftest then skips importing it (peft)


def test_a_rung_followed_by_a_load_error_is_reverted_and_the_ladder_goes_on(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """OOM -> checkpointing -> RuntimeError at load: checkpointing is reverted and never tried again,
    the same config is never retried, and the next rung (a smaller micro-batch) trains on."""
    monkeypatch.setenv(TEST_FAIL_WITH_KNOB, "gradient_checkpointing")
    job = capped_job(tiny_dir, tmp_path, max_steps=2, save_steps=2, supervise={"max_attempts": 6})
    code = run_job(
        str(job), plain=True, seams=Seams(tick_s=0.05), console=io.StringIO(), install_signals=False
    )
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    first, charged, *after = records
    assert first.failure is not None and first.failure.kind.is_oom, first.failure
    assert first.decision is not None and first.decision.rung == "gradient_checkpointing"
    assert charged.knobs.gradient_checkpointing
    assert charged.failure is not None and not charged.failure.kind.is_oom, charged.failure
    assert "injected fault" in (charged.failure.message or "")
    assert charged.decision is not None and "gradient_checkpointing reverted" in charged.decision.why
    assert after and all(not r.knobs.gradient_checkpointing for r in after)
    assert all(r.knobs != charged.knobs for r in after)  # the failing config is never retried
    assert after[0].knobs.micro_batch_size < first.knobs.micro_batch_size  # the ladder moved on
    assert {r.knobs.effective_batch for r in records} == {first.knobs.effective_batch}
    assert code == 0 and after[-1].outcome.value == "succeeded"
