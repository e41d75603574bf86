"""The short text table a card command prints last (the GPU machine returns little output).

One block per scenario: a line per approach, then the recoveries of the as-written runs (OOM →
next step, with and without the spare) and the supervisor's own CPU time and peak RSS. The full
numbers are in results.json; ``report.py`` turns them into RESULTS.md.
"""

from __future__ import annotations

from typing import Any

MiB = 1 << 20
COLUMNS = ("approach", "done", "att", "1st_step_s", "exec/kept/lost", "eff", "tok/s", "final config")


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def approach_cells(r: dict[str, Any]) -> tuple[str, ...]:
    if "skipped" in r:
        return (r["approach"], "skip", "-", "-", "-", "-", "-", str(r["skipped"])[:60])
    done = "yes" if r["finished"] else ("TIME" if r.get("timed_out") else "no")
    eff = f"{r['effective_batch_written']}->{_cell(r['effective_batch_final'])}"
    steps = f"{r['steps_executed']}/{r['steps_kept']}/{r['steps_lost']}"
    cells = (r["approach"], done, str(r["attempts"]), _cell(r["to_first_step_s"]), steps, eff)
    return (*cells, _cell(r["tokens_per_s"]), _cell(r["final_config"]))


def recovery_line(rows: list[dict[str, Any]]) -> str | None:
    """OOM -> next step of each supervised run (the median recovery): total = to training + first step."""
    parts = []
    for r in rows:
        found = sorted(r.get("recoveries") or [], key=lambda x: x["oom_to_step_s"])
        if not found:
            continue
        mid = found[len(found) // 2]
        spare = "/".join(sorted({_cell(x.get("warm_spare")) for x in found}))
        parts.append(
            f"{r['approach']} {mid['oom_to_step_s']:.1f} s = {_cell(mid['oom_to_training_s'])} + "
            f"{_cell(mid['first_step_s'])} step (spare {spare})"
        )
    return "OOM->next step: " + "; ".join(parts) if parts else None


def supervisor_line(rows: list[dict[str, Any]]) -> str | None:
    parts = [
        f"{r['approach']} {r['supervisor_cpu_s']:.1f} s CPU, {r['supervisor_peak_rss'] / MiB:.0f} MiB RSS"
        for r in rows
        if r.get("supervisor_cpu_s") is not None and r.get("supervisor_peak_rss")
    ]
    return "supervisor: " + "; ".join(parts) if parts else None


def scenario_block(name: str, info: dict[str, Any]) -> list[str]:
    rows = info.get("rows", [])
    cells = [COLUMNS, *(approach_cells(r) for r in rows)]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS) - 1)]
    lines = [
        f"== {name}: card {info['card']}, {info['shape']}, {info['written']}, {info['max_steps']} steps, "
        f"alongside {info.get('alongside', '?')} other card command(s) =="
    ]
    for c in cells:
        lines.append("  ".join(v.ljust(w) for v, w in zip(c, widths, strict=False)) + "  " + c[-1])
    shared = info.get("alongside") or 0
    note = (
        f"tok/s, step times: shares of a GPU {shared} other card command(s) used too; compare within a block"
        if shared
        else None
    )
    for extra in (recovery_line(rows), supervisor_line(rows), info.get("long_row_note"), note):
        if extra:
            lines.append(extra)
    return lines


def overhead_block(results: dict[str, Any]) -> list[str]:
    lines = []
    for name, o in results.items():
        beside = o.get("beside_spare_imports") or {}
        lines.append(
            f"== overhead {name}: {o['config']}: supervised {_cell(o['tokens_per_s_supervised'])} "
            f"tok/s vs bare {_cell(o['tokens_per_s_bare'])} = {_cell(o['overhead_pct'])} % over "
            f"{o['steps_measured']} steps (run medians {o['run_medians_supervised']} / "
            f"{o['run_medians_bare']}; bare runs differ by {_cell(o['noise_pct'])} %); "
            f"beside the spare's imports {_cell(beside.get('overhead_pct'))} % over "
            f"{beside.get('steps', 0)} steps; supervisor CPU {o['supervisor_cpu_s']} s, peak RSS "
            f"{[round((r or 0) / MiB) for r in o['supervisor_peak_rss']]} MiB =="
        )
        lines += [f"   {note}" for note in o.get("notes") or []]
    return lines
