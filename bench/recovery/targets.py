"""The issue's targets for qlora-supervise, checked against the measured rows (met / not met).

* finishes every scenario; 0 lost optimizer steps; the effective batch always kept (every
  supervised run: ``supervised`` and the ``as-written`` variants);
* overhead < 0.5 % tokens/s with the spare running (the ``--overhead`` runs, :mod:`.overhead`,
  pooled per scenario: met when the 95 % interval's upper end is below the limit, missed when its
  lower end is above it, else not resolved);
* supervisor RSS < 100 MB (every supervised run);
* OOM → next step ≤ 5 s plus one step's time (the recoveries that used the warm spare, alone on
  the GPU where such runs exist: card commands sharing it slow each other's loads), read twice:
  OOM → the next attempt's first forward pass ≤ 5 s (its first step is the "one step"), and,
  stricter, OOM → its first completed step ≤ 5 s plus that attempt's later steps' median (the
  first step's own warm-up, a fresh CUDA context's, then counts against the 5 s).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .overhead import pooled

RSS_LIMIT = 100_000_000
OVERHEAD_LIMIT_PCT = 0.5
RECOVERY_LIMIT_S = 5.0


def _supervised(runs: list[dict[str, Any]], alone: bool = False) -> list[tuple[str, dict[str, Any]]]:
    return [
        (name, r)
        for run in runs
        for name, info in run.get("scenarios", {}).items()
        for r in info["rows"]
        if r["approach"] in ("supervised", "as-written", "as-written-no-spare") and "skipped" not in r
        if not alone or info.get("alongside") == 0
    ]


def spare_recoveries(runs: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The recoveries in a warm spare the target is judged on, and which runs they come from."""
    for alone, where in ((True, "alone on the GPU"), (False, "beside other card commands")):
        rows = _supervised(runs, alone)
        found = [x for _, r in rows for x in r.get("recoveries") or [] if x.get("warm_spare")]
        if found:
            return found, where
    return [], "none"


def _line(met: bool | None, what: str, detail: str) -> str:
    verdict = "not measured" if met is None else ("met" if met else "NOT met")
    return f"- **{verdict}**: {what} ({detail})"


def check(runs: list[dict[str, Any]]) -> list[str]:
    rows = _supervised(runs)
    unfinished = [f"{n}/{r['approach']}" for n, r in rows if not r["finished"]]
    lost = sum(r["steps_lost"] for _, r in rows)
    cut = [f"{n}/{r['approach']}" for n, r in rows if not r["effective_batch_kept"]]
    rss = [r["supervisor_peak_rss"] for _, r in rows if r.get("supervisor_peak_rss")]
    spare, where = spare_recoveries(runs)
    some = bool(rows)
    return [
        _line(
            some and not unfinished,
            "qlora-supervise finishes every scenario",
            f"unfinished: {unfinished or 'none'}",
        ),
        _line(some and lost == 0, "0 lost optimizer steps", f"{lost} lost over {len(rows)} supervised runs"),
        _line(some and not cut, "the effective batch always kept", f"cut in: {cut or 'none'}"),
        overhead_line(runs),
        _line(
            max(rss) < RSS_LIMIT if rss else None,
            "supervisor RSS < 100 MB",
            f"peak {max(rss) / 1e6:.0f} MB" if rss else "no sample",
        ),
        *recovery_lines(spare, where),
    ]


def overhead_line(runs: list[dict[str, Any]]) -> str:
    """Judged on the runs: supervised (a spare beside each) against bare, pooled per scenario.
    ``spare_beside.py``'s steps, which are neighbours within one run and not independent, are
    told beside the verdict, not counted in it."""
    found = [(name, o) for run in runs for name, o in (run.get("overhead") or {}).items()]
    intervals = {name: i for name, i in pooled(found).items() if i is not None}
    what = f"overhead < {OVERHEAD_LIMIT_PCT} % tokens/s with the spare running"
    if not intervals:
        return _line(None, what, "fewer than two runs a side")
    highs = [i["high_pct"] for i in intervals.values()]
    lows = [i["low_pct"] for i in intervals.values()]
    met = True if max(highs) < OVERHEAD_LIMIT_PCT else (False if max(lows) > OVERHEAD_LIMIT_PCT else None)
    detail = "; ".join(
        f"{name}: {i['overhead_pct']} % (95 % CI {i['low_pct']} to {i['high_pct']} %, {i['n'][0]} + "
        f"{i['n'][1]} runs)"
        for name, i in intervals.items()
    )
    if met is None:
        detail += f": an interval holds {OVERHEAD_LIMIT_PCT} %, not resolved"
    for run in runs:
        slowdown = (run.get("spare_beside") or {}).get("slowdown")
        if slowdown:
            detail += (
                f"; not counted: {Path(run.get('_dir', '?')).name}'s steps beside a spare's imports "
                f"{slowdown['overhead_pct']} % slower ({slowdown['low_pct']} to {slowdown['high_pct']} %)"
            )
    return _line(met, what, detail)


def recovery_lines(spare: list[dict[str, Any]], where: str) -> list[str]:
    training = [x["oom_to_training_s"] for x in spare if x.get("oom_to_training_s") is not None]
    strict = [
        (x["oom_to_step_s"], round(RECOVERY_LIMIT_S + x["step_s"], 2)) for x in spare if x.get("step_s")
    ]
    what = f"OOM → next step ≤ {RECOVERY_LIMIT_S:.0f} s plus one step (warm spare, {where})"
    return [
        _line(
            max(training) <= RECOVERY_LIMIT_S if training else None,
            what + ": to the first forward pass",
            f"OOM → training: {training} s" if training else "no spare recovery",
        ),
        _line(
            all(took <= limit for took, limit in strict) if strict else None,
            what + ": to the first completed step, against 5 s plus a later step",
            f"(OOM → step, limit) {strict} s" if strict else "no spare recovery with later steps",
        ),
    ]
