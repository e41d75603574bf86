"""The issue's targets for qlora-supervise, checked against the measured rows (met / not met).

* finishes every scenario; 0 lost optimizer steps; the effective batch always kept (every
  supervised run: ``supervised`` and the ``as-written`` variants);
* overhead < 0.5 % tokens/s with the spare running (the ``--overhead`` runs; not judged when the
  steps' tokens/s spread more than :data:`NOISE_LIMIT_PCT`);
* supervisor RSS < 100 MB (every supervised run);
* OOM → next step ≤ 5 s plus one step's time (the recoveries that used the warm spare): OOM → the
  next attempt's first forward pass ≤ 5 s (:mod:`.measure`).
"""

from __future__ import annotations

from typing import Any

RSS_LIMIT = 100_000_000
OVERHEAD_LIMIT_PCT = 0.5
RECOVERY_LIMIT_S = 5.0
#: Steps whose tokens/s spread more than this (max − min over the median) cannot show 0.5 %.
NOISE_LIMIT_PCT = 10.0


def _supervised(runs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    return [
        (name, r)
        for run in runs
        for name, info in run.get("scenarios", {}).items()
        for r in info["rows"]
        if r["approach"] in ("supervised", "as-written", "as-written-no-spare") and "skipped" not in r
    ]


def _line(met: bool | None, what: str, detail: str) -> str:
    verdict = "not measured" if met is None else ("met" if met else "NOT met")
    return f"- **{verdict}**: {what} ({detail})"


def check(runs: list[dict[str, Any]]) -> list[str]:
    rows = _supervised(runs)
    unfinished = [f"{n}/{r['approach']}" for n, r in rows if not r["finished"]]
    lost = sum(r["steps_lost"] for _, r in rows)
    cut = [f"{n}/{r['approach']}" for n, r in rows if not r["effective_batch_kept"]]
    rss = [r["supervisor_peak_rss"] for _, r in rows if r.get("supervisor_peak_rss")]
    overheads = [o for run in runs for o in (run.get("overhead") or {}).values() if "overhead_pct" in o]
    costs = [o["overhead_pct"] for o in overheads if o["overhead_pct"] is not None]
    spreads = [
        v for o in overheads for v in (o.get("spread_supervised"), o.get("spread_bare")) if v is not None
    ]
    noisy = bool(spreads) and max(spreads) > NOISE_LIMIT_PCT
    spare = [x for _, r in rows for x in r.get("recoveries") or [] if x.get("warm_spare")]
    excess = [x["oom_to_training_s"] for x in spare if x.get("oom_to_training_s") is not None]
    some = bool(rows)
    return [
        _line(
            some and not unfinished,
            "qlora-supervise finishes every scenario",
            f"unfinished: {unfinished or 'none'}",
        ),
        _line(some and lost == 0, "0 lost optimizer steps", f"{lost} lost over {len(rows)} supervised runs"),
        _line(some and not cut, "the effective batch always kept", f"cut in: {cut or 'none'}"),
        _line(
            all(c < OVERHEAD_LIMIT_PCT for c in costs) if costs and not noisy else None,
            f"overhead < {OVERHEAD_LIMIT_PCT} % tokens/s",
            f"measured {costs} %, steps spread up to {max(spreads, default=0)} %"
            + (f": over {NOISE_LIMIT_PCT} %, too noisy to judge" if noisy else ""),
        ),
        _line(
            max(rss) < RSS_LIMIT if rss else None,
            "supervisor RSS < 100 MB",
            f"peak {max(rss) / 1e6:.0f} MB" if rss else "no sample",
        ),
        _line(
            max(excess) <= RECOVERY_LIMIT_S if excess else None,
            f"OOM → next step ≤ {RECOVERY_LIMIT_S:.0f} s plus one step (warm spare)",
            f"OOM → training (the next step's own time left out): {excess} s"
            if excess
            else "no spare recovery",
        ),
    ]
