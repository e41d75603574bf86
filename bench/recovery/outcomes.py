"""One result row per approach run (:func:`measure.row` plus what only that approach has).

The supervised rows add the recoveries (OOM → next step, spare or not), the supervisor's own CPU
time and peak RSS; the restart loop adds the exit codes; auto-batch the batch sizes it tried
and the error it gave up with. :func:`overhead` compares a supervised run's tokens/s with the
same final spec run bare.
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

import gpu_ladder

from recovery import measure
from recovery.measure import Attempt
from recovery.scenarios import Scenario


def supervised(s: Scenario, approach: str, out: dict[str, Any]) -> dict[str, Any]:
    from qlora_supervise.supervisor.record.journal import read_attempts

    run_dir, launch = Path(out["run_dir"]), out["launch"]
    attempts = measure.attempts_in(run_dir)
    finished = launch["exit_code"] == 0
    result = measure.row(s, approach, attempts, finished, launch["started_at"])
    measure.with_kept(result, measure.kept_steps(run_dir, finished, s.max_steps))
    records, _ = read_attempts(run_dir / "attempts.jsonl")
    events = gpu_ladder.read_jsonl(run_dir / "events.jsonl")
    ended = {r.attempt: r.ended_at for r in records}
    kinds = {r.attempt: str(r.failure.kind.value) for r in records if r.failure is not None}
    result["failures"] = [kinds[n] for n in sorted(kinds)]
    result["recoveries"] = recoveries(attempts, ended, kinds, events)
    result["spare_used"] = sum(1 for e in events if e.get("event") == "spare_used")
    result["supervisor_cpu_s"] = launch["cpu_s"]
    result["supervisor_peak_rss"] = launch["peak_rss"]
    result["exit_code"], result["timed_out"] = launch["exit_code"], launch["timed_out"]
    result["wall_s"] = launch["wall_s"]
    return result


def recoveries(
    attempts: list[Attempt], ended: dict[int, float], kinds: dict[int, str], events: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """Each attempt after a failure that completed a step: how long from the failure to that step."""
    logged = {e.get("attempt"): e for e in events if e.get("event") == "first_step"}
    found = []
    for before, after in itertools.pairwise(attempts):
        first = after.first_step_at()
        failed = before.failed_at or ended.get(before.number)
        if first is None or failed is None:
            continue
        event = logged.get(after.number, {})
        found.append(
            {
                "after_attempt": before.number,
                "failure": kinds.get(before.number),
                "attempt": after.number,
                "oom_to_step_s": round(first - failed, 2),
                "oom_to_training_s": round(after.training_at - failed, 2) if after.training_at else None,
                "first_step_s": after.first_step_s(),
                "since_failure_s_logged": event.get("since_failure_s"),
                "warm_spare": event.get("warm_spare"),
                "step_s": after.step_s(),
            }
        )
    return found


def restart_loop(s: Scenario, out: dict[str, Any]) -> dict[str, Any]:
    run_dir, runs = Path(out["run_dir"]), out["attempts"]
    attempts = measure.attempts_in(run_dir)
    finished = bool(runs) and runs[-1]["launch"]["exit_code"] == 0
    started = runs[0]["launch"]["started_at"] if runs else 0.0
    result = measure.row(s, "restart-loop", attempts, finished, started)
    measure.with_kept(result, measure.kept_steps(run_dir, finished, s.max_steps))
    result["exit_codes"] = [r["launch"]["exit_code"] for r in runs]
    result["restarts_allowed"] = out["restarts_allowed"]
    result["timed_out"] = any(r["launch"]["timed_out"] for r in runs)
    result["wall_s"] = round(sum(r["launch"]["wall_s"] for r in runs), 1)
    return result


def tries(events: list[dict[str, Any]], knobs: dict[str, Any]) -> list[Attempt]:
    """auto-batch's tries, split at each ``try_started``; each restarts at step 0."""
    groups: list[tuple[dict[str, Any], list[dict[str, Any]]]] = []
    for event in events:
        if event.get("event") == "try_started":
            groups.append((event, []))
        elif groups:
            groups[-1][1].append(event)
    found = []
    for number, (start, rest) in enumerate(groups, 1):
        times, rates = measure.step_log(rest)
        failed = next((e["time"] for e in rest if e.get("event") == "try_failed"), None)
        tried = dict(knobs, micro_batch_size=start.get("batch_size"), grad_accum=start.get("grad_accum"))
        found.append(Attempt(number, 0, times, rates, tried, failed))
    return found


def auto_batch(s: Scenario, out: dict[str, Any]) -> dict[str, Any]:
    from qlora_supervise.trainer_child.checkpoint_dirs import checkpoint_step

    run_dir, launch = Path(out["run_dir"]), out["launch"]
    attempt_dir = run_dir / "attempt-001"
    events = gpu_ladder.read_jsonl(attempt_dir / "child-events.jsonl")
    spec = measure.read_attempt(attempt_dir)
    attempts = tries(events, spec.knobs if spec else {})
    finished = launch["exit_code"] == 0 and any(e.get("event") == "finished" for e in events)
    result = measure.row(s, "auto-batch", attempts, finished, launch["started_at"])
    # Trainer's own checkpoint-N directories (no completion marker): what a rerun could resume.
    saved = [checkpoint_step(p) for p in (run_dir / "checkpoints").glob("checkpoint-*")]
    measure.with_kept(result, s.max_steps if finished else max((n for n in saved if n), default=0))
    result["batch_sizes"] = [a.knobs.get("micro_batch_size") for a in attempts]
    gave_up = next((e for e in events if e.get("event") == "gave_up"), None)
    result["gave_up"] = gave_up.get("error") if gave_up else None
    result["exit_code"], result["timed_out"] = launch["exit_code"], launch["timed_out"]
    result["wall_s"] = launch["wall_s"]
    return result


def overhead(supervised_run: dict[str, Any], bare_run: dict[str, Any]) -> dict[str, Any]:
    """Tokens/s of the supervised run's final attempt against the same spec run bare."""
    sup = measure.attempts_in(Path(supervised_run["run_dir"]))
    bare = measure.attempts_in(Path(bare_run["run_dir"]))
    sup_rate = sup[-1].median_rate() if sup else None
    bare_rate = bare[-1].median_rate() if bare else None
    cost = None
    if sup_rate and bare_rate:
        cost = round(100.0 * (bare_rate - sup_rate) / bare_rate, 2)
    steps = [len(a.rates) for a in (sup[-1:] + bare[-1:])]
    return {
        "config": measure.config_text(sup[-1].knobs) if sup else None,
        "tokens_per_s_supervised": sup_rate,
        "tokens_per_s_bare": bare_rate,
        "overhead_pct": cost,
        "steps_measured": steps,
        "supervisor_cpu_s": supervised_run["launch"]["cpu_s"],
        "supervisor_peak_rss": supervised_run["launch"]["peak_rss"],
        "spread_supervised": _spread(sup[-1]) if sup else None,
        "spread_bare": _spread(bare[-1]) if bare else None,
    }


def _spread(attempt: Attempt) -> float | None:
    """The steps' tokens/s spread (max − min over the median, in %), to judge the overhead's noise."""
    values = [v for step, v in sorted(attempt.rates.items())[1:]]
    if len(values) < 2:
        return None
    return round(100.0 * (max(values) - min(values)) / statistics.median(values), 1)
