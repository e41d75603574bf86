"""bench/recovery's readers and checks on hand-made files (no trainer runs: `run.py --tiny` does those)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.recovery import measure, outcomes, overhead, targets
from bench.recovery.assets import long_row_position


def beat(step: int, at: float, rate: float | None = 100.0) -> dict[str, object]:
    return {"event": "heartbeat", "step": step, "time": at, "tokens_per_s": rate}


def write_attempt(run: Path, number: int, events: list[dict[str, object]], **spec: object) -> None:
    directory = run / f"attempt-{number:03d}"
    directory.mkdir(parents=True)
    knobs = {"micro_batch_size": 4, "grad_accum": 4, "max_seq_len": 2048, "optimizer": "adamw_torch"}
    (directory / "spec.json").write_text(json.dumps({"attempt": number, "knobs": knobs, **spec}))
    (directory / "child-events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def test_step_log_times_each_step_by_its_first_heartbeat() -> None:
    """A step's time and tokens/s come from its first heartbeat, not the timer beats that repeat it."""
    times, rates = measure.step_log([beat(1, 10.0, 50.0), beat(1, 15.0, 50.0), beat(2, 20.0, 70.0)])
    assert times == {1: 10.0, 2: 20.0}
    assert rates == {1: 50.0, 2: 70.0}


def test_recovery_runs_from_the_failure_to_the_next_attempts_first_step(tmp_path: Path) -> None:
    """OOM -> next step is the failed attempt's failed_at to the next attempt's first new step,
    split at the next attempt's first forward pass."""
    write_attempt(tmp_path, 1, [beat(1, 100.0), beat(2, 110.0)])
    (tmp_path / "attempt-001" / "error.json").write_text(json.dumps({"failed_at": 115.0, "time": 116.0}))
    forward = {"event": "stage", "stage": "forward", "time": 121.0}
    resume = "/x/checkpoints/checkpoint-2"
    write_attempt(tmp_path, 2, [beat(2, 119.0), forward, beat(3, 125.0), beat(4, 129.0)], resume_from=resume)
    attempts = measure.attempts_in(tmp_path)
    logged = [{"event": "first_step", "attempt": 2, "since_failure_s": 9.9, "warm_spare": True}]
    (found,) = outcomes.recoveries(attempts, {1: 117.0}, {1: "oom_forward"}, logged)
    assert found["oom_to_step_s"] == 10.0
    assert found["oom_to_training_s"] == 6.0 and found["first_step_s"] == 4.0
    assert found["warm_spare"] is True and found["since_failure_s_logged"] == 9.9
    assert attempts[1].resumed_from == 2 and attempts[1].executed == 2


def test_auto_batch_tries_restart_at_step_zero_with_the_batch_they_tried() -> None:
    """Each try_started opens a try; its steps and batch size are its own."""
    events = [
        {"event": "try_started", "batch_size": 4, "grad_accum": 4, "time": 1.0},
        beat(1, 2.0),
        {"event": "try_failed", "batch_size": 4, "step": 1, "time": 3.0},
        {"event": "try_started", "batch_size": 3, "grad_accum": 4, "time": 4.0},
        beat(1, 5.0),
        beat(2, 6.0),
    ]
    first, second = outcomes.tries(events, {"optimizer": "adamw_torch"})
    assert (first.executed, first.failed_at, first.knobs["micro_batch_size"]) == (1, 3.0, 4)
    assert (second.executed, second.knobs["micro_batch_size"] * second.knobs["grad_accum"]) == (2, 12)


def test_long_row_lands_where_accelerates_sampler_draws_it() -> None:
    """The row the bench places for step 4 is the one accelerate's seeded sampler draws in step 4."""
    import torch
    from accelerate.data_loader import SeedableRandomSampler

    torch.manual_seed(42)  # what Trainer's set_seed(args.seed) leaves as the initial seed
    order = list(SeedableRandomSampler(data_source=range(96)))
    index = long_row_position(96, 16, 4, 42)
    assert order.index(index) // 16 == 3


def test_targets_name_what_is_missed() -> None:
    """A lost step and a cut batch are reported as not met; unmeasured targets say so."""
    row = {"approach": "as-written", "finished": True, "steps_lost": 1, "effective_batch_kept": False}
    lines = targets.check([{"scenarios": {"s": {"rows": [row]}}}])
    assert "**NOT met**: 0 lost optimizer steps" in lines[1]
    assert "**NOT met**: the effective batch always kept" in lines[2]
    assert lines[3].startswith("- **not measured**")


def test_the_overhead_interval_comes_from_the_runs_and_decides_the_target() -> None:
    """Welch's interval from run medians: equal sides give 0 %; a clear 2 % cost is missed; a
    wide interval around the limit is not resolved."""
    same = overhead.interval([100.0, 101.0, 99.0], [100.0, 101.0, 99.0])
    assert same is not None and same["overhead_pct"] == 0.0 and same["low_pct"] < 0 < same["high_pct"]
    assert overhead.interval([100.0], [100.0, 101.0]) is None  # one run a side: no spread to judge by
    assert overhead.interval([100.0, 100.0], [100.0, 100.0]) is None  # no spread at all either
    # By hand: means 11 and 12, each variance 2 over 2 runs, so SE sqrt(2) and Welch df 2 (t 4.303);
    # the cost 1/12 = 8.33 %, the half-width 4.303 * 1.4142 / 12 = 50.71 %.
    assert overhead.interval([10.0, 12.0], [11.0, 13.0]) == {
        "overhead_pct": 8.33,
        "low_pct": -42.38,
        "high_pct": 59.04,
        "n": [2, 2],
        "df": 2.0,
    }

    def judged(sup: list[float], bare: list[float]) -> str:
        o = {"run_medians_supervised": sup, "run_medians_bare": bare}
        return targets.overhead_line([{"overhead": {"s": o}}])

    assert judged([98.0, 98.1, 97.9], [100.0, 100.1, 99.9]).startswith("- **NOT met**")
    assert judged([100.0, 100.05, 99.95], [100.0, 100.05, 99.95]).startswith("- **met**")
    assert judged([99.5, 101.0, 98.0], [100.0, 101.5, 98.5]).startswith("- **not measured**")


def test_a_step_beside_a_window_is_one_that_overlapped_it() -> None:
    """A step counts as beside a spare's imports when any part of it overlapped them."""
    rates = {2: 10.0, 3: 20.0, 4: 30.0}
    ended, began = {2: 5.0, 3: 10.0, 4: 15.0}, {2: 0.0, 3: 5.0, 4: 10.0}
    inside, outside = overhead.split_by_windows(rates, ended, [(9.0, 9.5)], began)
    assert (inside, outside) == ([20.0], [10.0, 30.0])
    assert overhead.split_by_windows(rates, ended, [(9.0, 9.5)]) == ([], [10.0, 20.0, 30.0])
