"""A rung charged with the error that followed it, in a whole run with the scripted child (real processes)."""

from __future__ import annotations

from pathlib import Path

from test_loop import _events, _job, _run

from qlora_supervise.supervisor.record.journal import read_attempts


def test_an_error_right_after_a_rung_reverts_it_and_the_run_finishes(tmp_path: Path) -> None:
    """OOM -> checkpointing -> a config error at once: checkpointing is charged (reverted, unusable),
    the micro-batch halves instead, and the run finishes; the failing config is never retried."""
    assert _run(_job(tmp_path, {"1": "oom_forward@1", "2": "config_error", "default": "ok"})) == 0
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert [r.outcome.value for r in records] == ["failed", "failed", "succeeded"]
    first, second, third = records
    assert second.knobs.gradient_checkpointing and not first.knobs.gradient_checkpointing
    assert second.decision is not None and "reverted and unusable for this run" in second.decision.why
    assert second.decision.rung == "halve_micro_batch"
    assert not third.knobs.gradient_checkpointing
    assert third.knobs.micro_batch_size < first.knobs.micro_batch_size
    assert third.knobs.effective_batch == first.knobs.effective_batch
    retries = _events(tmp_path, "retry")
    assert any("reverted" in str(event.get("why", "")) for event in retries)
