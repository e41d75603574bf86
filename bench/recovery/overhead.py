"""What supervising costs: one config's tokens/s under ``qlora-supervise run`` (its warm spare
importing beside it) against the same spec run bare, alone on the GPU.

How, and why so:

* **No memory cap, no saves in between.** The scenario's job runs with the card's whole memory
  (``card="none"``) and saves only after its last step. Under a cap near the step's peak the
  allocator frees and retries, and steps of one run differed by 10–50 % (bench/results,
  2026-12-01); a checkpoint between steps adds its own disk time. Neither is the supervisor's.
* **Interleaved.** Supervised (S) and bare (B) runs alternate S B B S S B …, so a drift of the
  card over the command (clocks, temperature, page cache) falls on both sides alike.
* **Steps, not runs.** A run's steps are timed from each step's first heartbeat (written when
  the step completes; ``tokens_per_s`` is the step's tokens over its time), the first step left
  out (warm-up). Each side's tokens/s is the median of all its steps; the overhead compares them.
* **The noise, measured.** Runs of one spec differ by something the supervisor cannot cause,
  so the runs, not the steps, are the samples: :func:`interval` gives the overhead's 95 %
  confidence interval from the runs' medians (Welch's t), and the target is judged on its ends
  (met when the upper end is below the limit, missed when the lower end is above it). Runs of
  several ``--overhead`` commands on the same scenario are pooled (:func:`pooled`).
* **The spare's imports.** The supervised steps that completed while the spare was importing
  (from ``spare_started`` to its ``import_s`` + ``prepare_s`` later) are reported on their own:
  a spare must not slow the attempt it stands behind.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any

from ..scenarios import gpu_ladder
from . import approaches, measure
from .approaches import Place

SUPERVISED = "supervised-spare"


def order(pairs: int) -> list[str]:
    """S B, B S, S B, …: each pair's first run is the other side of the previous pair's last."""
    sides: list[str] = []
    for pair in range(pairs):
        sides += ["supervised", "bare"] if pair % 2 == 0 else ["bare", "supervised"]
    return sides


@dataclasses.dataclass(frozen=True)
class Steps:
    """One run's measured steps: step -> (completed at, tokens/s), the first step left out."""

    side: str
    name: str
    rates: dict[int, float]
    ended: dict[int, float]
    began: dict[int, float]  # the previous step's end

    def median(self) -> float | None:
        return statistics.median(self.rates.values()) if self.rates else None


def steps_of(run_dir: Path, side: str, name: str) -> Steps | None:
    """The final attempt's steps of the run in ``run_dir`` (None without a completed step)."""
    attempts = measure.attempts_in(run_dir)
    if not attempts:
        return None
    last = attempts[-1]
    steps = sorted(s for s in last.rates if s > last.resumed_from)[1:]
    ended = {s: last.step_times[s] for s in steps}
    began = {s: last.step_times[s - 1] for s in steps if s - 1 in last.step_times}
    return Steps(side, name, {s: last.rates[s] for s in steps}, ended, began)


def spare_windows(run_dir: Path) -> list[tuple[float, float]]:
    """(start, end) wall times of each spare's imports and preparation in a supervised run: from
    its ``spare_started`` to its ``import_s`` + ``prepare_s`` later (its ``spare_ready`` line)."""
    from qlora_supervise.supervisor.loop.spare import ready_line

    events = gpu_ladder.read_jsonl(run_dir / "events.jsonl")
    windows = []
    for event in events:
        if event.get("event") != "spare_started":
            continue
        ready = ready_line(run_dir / "spare.log", event.get("pid"))
        if ready is not None:
            busy = float(ready.get("import_s") or 0) + float(ready.get("prepare_s") or 0)
            windows.append((float(event["time"]), float(event["time"]) + busy))
    return windows


def split_by_windows(
    rates: dict[int, float],
    ended: dict[int, float],
    windows: list[tuple[float, float]],
    began: dict[int, float] | None = None,
) -> tuple[list[float], list[float]]:
    """(values of the steps that overlapped a window, values of the steps that overlapped none).
    A step runs from ``began`` (the previous step's end) to ``ended``; without ``began`` only its
    end is placed."""

    def overlaps(step: int) -> bool:
        start = (began or {}).get(step, ended[step])
        return any(start <= b and ended[step] >= a for a, b in windows)

    inside = [v for step, v in rates.items() if overlaps(step)]
    outside = [v for step, v in rates.items() if not overlaps(step)]
    return inside, outside


#: Student's t, two-sided 95 %, by degrees of freedom (standard tables); beyond 30, the normal's.
T_975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
T_975 |= {10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160, 14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110}
T_975 |= {18: 2.101, 19: 2.093, 20: 2.086, 21: 2.080, 22: 2.074, 23: 2.069, 24: 2.064, 25: 2.060}
T_975 |= {26: 2.056, 27: 2.052, 28: 2.048, 29: 2.045, 30: 2.042, 40: 2.021, 60: 2.000, 120: 1.980}


def t_975(df: float) -> float:
    """The table's t at the largest tabled degrees of freedom not above ``df`` (conservative)."""
    return T_975[max(d for d in T_975 if d <= max(1.0, df))]


def interval(supervised: list[float], bare: list[float]) -> dict[str, Any] | None:
    """The overhead (how much slower supervised runs are, in % of bare tokens/s) with its 95 %
    confidence interval, from each side's run medians (Welch's t, its degrees of freedom taken
    down to the table's, which widens it; the bare mean it is a share of is taken as exact).
    None with fewer than two samples a side, or none that differ (no spread to judge by)."""
    if len(supervised) < 2 or len(bare) < 2:
        return None
    mean_s, mean_b = statistics.fmean(supervised), statistics.fmean(bare)
    var_s, var_b = statistics.variance(supervised) / len(supervised), statistics.variance(bare) / len(bare)
    if var_s + var_b == 0 or mean_b == 0:
        return None
    df = (var_s + var_b) ** 2 / (var_s**2 / (len(supervised) - 1) + var_b**2 / (len(bare) - 1))
    cost = 100.0 * (mean_b - mean_s) / mean_b
    half = 100.0 * t_975(df) * (var_s + var_b) ** 0.5 / mean_b
    return {
        "overhead_pct": round(cost, 2),
        "low_pct": round(cost - half, 2),
        "high_pct": round(cost + half, 2),
        "n": [len(supervised), len(bare)],
        "df": round(df, 1),
    }


def pooled(results: list[tuple[str, dict[str, Any]]]) -> dict[str, dict[str, Any] | None]:
    """:func:`interval` per scenario over the run medians of every overhead result given."""
    medians: dict[str, tuple[list[float], list[float]]] = {}
    for name, o in results:
        sides = medians.setdefault(name, ([], []))
        sides[0].extend(o.get("run_medians_supervised") or [])
        sides[1].extend(o.get("run_medians_bare") or [])
    return {name: interval(*sides) for name, sides in medians.items()}


def _pct(a: float | None, b: float | None) -> float | None:
    """How much slower ``a`` (tokens/s) is than ``b``, in % of ``b``."""
    return round(100.0 * (b - a) / b, 2) if a and b else None


def _spread(values: list[float]) -> float | None:
    """max − min over the median, in %: None for fewer than two values."""
    if len(values) < 2:
        return None
    return round(100.0 * (max(values) - min(values)) / statistics.median(values), 2)


def summary(runs: list[Steps], windows: list[tuple[float, float]]) -> dict[str, Any]:
    """Both sides' tokens/s, the overhead, the noise, and the steps beside the spare's imports."""
    sides = {side: [r for r in runs if r.side == side] for side in ("supervised", "bare")}
    pooled = {side: [v for r in rs for v in r.rates.values()] for side, rs in sides.items()}
    rate = {side: round(statistics.median(v), 1) if v else None for side, v in pooled.items()}
    medians = {side: [round(m, 1) for r in rs if (m := r.median()) is not None] for side, rs in sides.items()}
    beside = [v for r in sides["supervised"] for v in split_by_windows(r.rates, r.ended, windows, r.began)[0]]
    beside_rate = round(statistics.median(beside), 1) if beside else None
    return {
        "order": [r.side for r in runs],
        "tokens_per_s_supervised": rate["supervised"],
        "tokens_per_s_bare": rate["bare"],
        "overhead_pct": _pct(rate["supervised"], rate["bare"]),
        "run_medians_supervised": medians["supervised"],
        "run_medians_bare": medians["bare"],
        "noise_pct": _spread(medians["bare"]),
        "interval": interval(medians["supervised"], medians["bare"]),
        "steps_measured": {side: len(v) for side, v in pooled.items()},
        "beside_spare_imports": {
            "steps": len(beside),
            "tokens_per_s": beside_rate,
            "overhead_pct": _pct(beside_rate, rate["bare"]),
        },
    }


def measure_overhead(place: Place, pairs: int, limits: Any) -> dict[str, Any]:
    """Run the S/B sequence of ``pairs`` pairs on ``place``; ``limits.next()`` gives each run's
    time limit (None: no time left). The summary, each run's supervisor CPU and RSS, and the
    run directories (for keeping)."""
    runs: list[Steps] = []
    windows: list[tuple[float, float]] = []
    spec_json: str | None = None
    cpu, rss, dirs, notes = [], [], [], []
    counts = {"supervised": 0, "bare": 0}
    for side in order(pairs):
        limit = limits.next()
        if limit is None:
            notes.append(f"{side}: no time left within --deadline-s")
            continue
        counts[side] += 1
        name = f"{side}-{counts[side]}"
        if side == "supervised":
            out = approaches.supervised(place, SUPERVISED, limit, name=name)
            launch = out["launch"]
            cpu.append(launch["cpu_s"])
            rss.append(launch["peak_rss"])
            run_dir = Path(out["run_dir"])
            windows += spare_windows(run_dir)
            specs = sorted(run_dir.glob("attempt-[0-9][0-9][0-9]/spec.json"))
            spec_json = spec_json or (specs[-1].read_text(encoding="utf-8") if specs else None)
        elif spec_json is None:
            notes.append(f"{name}: skipped, no supervised attempt wrote a spec before it")
            continue
        else:
            out = approaches.bare(spec_json, place.runs / name, limit)
        dirs.append((name, out))
        steps = steps_of(Path(out["run_dir"]), side, name)
        if steps is None:
            notes.append(f"{name}: no step completed")
            continue
        runs.append(steps)
    first_spec = json.loads(spec_json) if spec_json else {}
    return {
        "config": measure.config_text(first_spec.get("knobs") or {}),
        **summary(runs, windows),
        "supervisor_cpu_s": cpu,
        "supervisor_peak_rss": rss,
        "notes": notes,
        "_dirs": dirs,
    }
