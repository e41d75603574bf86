"""One result row per approach run (:func:`measure.row` plus what only that approach has).

The supervised rows add the recoveries (OOM → next step, spare or not), the supervisor's own CPU
time and peak RSS; the restart loop adds the exit codes; auto-batch the batch sizes it tried
and the error it gave up with. The overhead runs have their own module (:mod:`.overhead`).
"""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path
from typing import Any

from ..scenarios import gpu_ladder
from . import measure
from .measure import Attempt
from .overhead import spare_windows, split_by_windows
from .scenarios import Scenario


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
    result["beside_spare_imports"] = beside_spare_imports(attempts, spare_windows(run_dir))
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


def beside_spare_imports(attempts: list[Attempt], windows: list[tuple[float, float]]) -> dict[str, Any]:
    """The final attempt's step times while a spare imported beside it, and once none did: a
    spare behind a warm attempt starts after its first step and imports through the next ones."""
    final = attempts[-1] if attempts else None
    if final is None:
        return {}
    times = [t for s, t in sorted(final.step_times.items()) if s > final.resumed_from]
    steps = sorted(s for s in final.step_times if s > final.resumed_from)
    pairs = list(itertools.pairwise(zip(steps, times, strict=True)))
    gaps = {b: tb - ta for (_, ta), (b, tb) in pairs}
    inside, outside = split_by_windows(gaps, final.step_times, windows, {b: ta for (_, ta), (b, _) in pairs})
    median = statistics.median
    return {
        "steps_beside": len(inside),
        "step_s_beside": round(median(inside), 2) if inside else None,
        "steps_after": len(outside),
        "step_s_after": round(median(outside), 2) if outside else None,
    }


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
    from qlora_supervise.trainer_child.contract.checkpoints import checkpoint_step

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
