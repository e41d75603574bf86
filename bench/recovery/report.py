"""RESULTS.md and the summary table of docs/recovery.md from one or more ``run.py`` output directories.

    python -m bench.recovery.report OUT/8GiB OUT/16GiB OUT/24GiB OUT/32GiB OUT/overhead \\
        [--results bench/recovery/RESULTS.md] [--readme docs/recovery.md]

Reads each ``OUT/results.json`` (card runs and ``--overhead`` runs alike) and writes RESULTS.md:
the exact commands, versions, date and device, the definitions, the summary (the three
approaches side by side), every approach's full row, the recoveries (OOM → next step, spare or
not), the supervisor's own CPU and RSS, the overhead, and the issue's targets met or not.
``--readme`` replaces the block between ``<!-- bench-recovery:start -->`` and
``<!-- bench-recovery:end -->`` in that file with the summary table. Nothing is measured here.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from . import measure, outcomes, targets
from .overhead import interval, pooled, spare_windows

START, END = "<!-- bench-recovery:start -->", "<!-- bench-recovery:end -->"
MiB = 1 << 20
SIDE_BY_SIDE = (
    ("supervised", "qlora-supervise"),
    ("restart-loop", "restart loop"),
    ("auto-batch", "auto_find_batch_size"),
)


def load(dirs: list[Path]) -> list[dict[str, Any]]:
    found = []
    for directory in dirs:
        path = directory / "results.json"
        if not path.is_file():
            raise SystemExit(f"{path}: no results.json (give the --out directories of run.py)")
        run = json.loads(path.read_text(encoding="utf-8")) | {"_dir": str(directory)}
        rescore(run, directory)
        found.append(run)
    return found


def rescore(run: dict[str, Any], directory: Path) -> None:
    """Steps beside a spare's imports again, from the kept journals, by this code's rule (a
    results file keeps the rule of the code that wrote it)."""
    for scenario, info in run.get("scenarios", {}).items():
        for row in info["rows"]:
            kept = directory / scenario / row["approach"]
            if "beside_spare_imports" in row and (kept / "events.jsonl").is_file():
                attempts = measure.attempts_in(kept)
                row["beside_spare_imports"] = outcomes.beside_spare_imports(attempts, spare_windows(kept))


def _v(value: Any, unit: str = "") -> str:
    return "—" if value is None else f"{value}{unit}"


def cell(r: dict[str, Any] | None) -> str:
    """One approach in the summary: finished or not, attempts, lost steps, effective batch, tokens/s."""
    if r is None:
        return "not run"
    if "skipped" in r:
        return f"skipped ({r['skipped']})"
    done = "**finished**" if r["finished"] else ("timed out" if r.get("timed_out") else "**not finished**")
    eff = f"batch {r['effective_batch_written']}"
    if r["effective_batch_final"] != r["effective_batch_written"]:
        eff = f"batch {r['effective_batch_written']} → **{_v(r['effective_batch_final'])}**"
    first = f", 1st step at {r['to_first_step_s']:.0f} s" if r.get("to_first_step_s") else ""
    rate = f", {r['tokens_per_s']:.0f} tok/s" if r["finished"] and r.get("tokens_per_s") else ""
    lost = f"{r['steps_lost']} of {r['steps_executed']} steps lost"
    return f"{done}: {r['attempts']} att.{first}, {lost}, {eff}{rate}"


def scenarios(runs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """Each scenario once, in the order first seen; a later directory's row of an approach
    replaces an earlier one (a rerun of part of a card), the others stay. A run alone on the GPU
    is kept apart from the same scenario run beside other card commands (their timings differ),
    and from other runs alone (each is a measurement of its own), named by its directory."""
    merged: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {}
    for run in runs:
        for scenario, info in run.get("scenarios", {}).items():
            alone = f"{scenario} (alone on the GPU, {Path(run['_dir']).name})"
            name = alone if info.get("alongside") == 0 else scenario
            if name not in merged:
                merged[name] = (dict(info, rows=list(info["rows"])), run)
                continue
            rows = {r["approach"]: r for r in merged[name][0]["rows"]}
            rows |= {r["approach"]: r for r in info["rows"]}
            merged[name][0]["rows"] = list(rows.values())
    return [(name, info, run) for name, (info, run) in merged.items()]


def summary_table(runs: list[dict[str, Any]]) -> list[str]:
    head = "| scenario | " + " | ".join(label for _, label in SIDE_BY_SIDE) + " |"
    lines = [head, "|" + " --- |" * (len(SIDE_BY_SIDE) + 1)]
    for name, info, _ in scenarios(runs):
        by = {r["approach"]: r for r in info["rows"]}
        if not any(a in by for a, _ in SIDE_BY_SIDE):
            continue  # a run of the recovery approaches only (e.g. alone on the GPU): its own table
        lines.append(
            f"| {name} ({info['written']}) | " + " | ".join(cell(by.get(a)) for a, _ in SIDE_BY_SIDE) + " |"
        )
    return lines


def full_rows(runs: list[dict[str, Any]]) -> list[str]:
    cols = ["approach", "finished", "attempts", "to 1st step (s)", "executed", "kept", "lost", "eff. batch"]
    cols += ["tokens/s", "final config", "wall (s)", "limit (s)"]
    lines = []
    for name, info, _ in scenarios(runs):
        lines += [
            f"### {name}",
            "",
            f"Card {info['card']}, shape {info['shape']}, written {info['written']}, "
            f"{info['max_steps']} steps; {info.get('alongside', '?')} other card command(s) ran beside it.",
        ]
        if info.get("long_row_note"):
            lines.append(f"{info['long_row_note']}.")
        lines += ["", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
        for r in info["rows"]:
            if "skipped" in r:
                lines.append(f"| {r['approach']} | skipped: {r['skipped']} |" + " |" * (len(cols) - 2))
                continue
            eff = f"{r['effective_batch_written']} → {_v(r['effective_batch_final'])}"
            values = [
                r["approach"],
                "yes" if r["finished"] else "no",
                r["attempts"],
                _v(r["to_first_step_s"]),
            ]
            values += [r["steps_executed"], r["steps_kept"], r["steps_lost"], eff, _v(r["tokens_per_s"])]
            values += [_v(r["final_config"]), _v(r.get("wall_s")), _v(r.get("limit_s"))]
            lines.append("| " + " | ".join(map(str, values)) + " |")
        extras = [_extra(r) for r in info["rows"] if "skipped" not in r and _extra(r)]
        lines += ["", *extras, ""] if extras else [""]
    return lines


def _extra(r: dict[str, Any]) -> str:
    if r["approach"] == "auto-batch":
        return f"- auto-batch tried batch sizes {r.get('batch_sizes')}; gave up with: {_v(r.get('gave_up'))}"
    if r["approach"] == "restart-loop":
        return (
            f"- restart loop exit codes {r.get('exit_codes')} ({r.get('restarts_allowed')} restarts allowed)"
        )
    if r.get("failures"):
        return f"- {r['approach']} failures: {', '.join(r['failures'])}"
    return ""


def recovery_rows(runs: list[dict[str, Any]]) -> list[str]:
    cols = ["scenario", "run", "after attempt", "failure", "warm spare", "OOM → next step (s)"]
    cols += ["OOM → training (s)", "first step (s)", "later steps (s)", "logged since_failure_s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for name, info, _ in scenarios(runs):
        for r in info["rows"]:
            for x in r.get("recoveries") or []:
                values = [name, r["approach"], x["after_attempt"], _v(x["failure"]), _v(x["warm_spare"])]
                values += [x["oom_to_step_s"], _v(x.get("oom_to_training_s")), _v(x.get("first_step_s"))]
                values += [_v(x["step_s"]), _v(x["since_failure_s_logged"])]
                lines.append("| " + " | ".join(map(str, values)) + " |")
    return lines


def beside_rows(runs: list[dict[str, Any]]) -> list[str]:
    """The final attempt's steps while a new spare imported beside it, and after."""
    cols = ["scenario", "run", "steps beside", "step (s) beside", "steps after", "step (s) after"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for name, info, _ in scenarios(runs):
        for r in info["rows"]:
            b = r.get("beside_spare_imports") or {}
            if b.get("steps_beside"):
                values = [name, r["approach"], b["steps_beside"], _v(b["step_s_beside"])]
                values += [b["steps_after"], _v(b["step_s_after"])]
                lines.append("| " + " | ".join(map(str, values)) + " |")
    return lines if len(lines) > 2 else []


def spare_beside_rows(runs: list[dict[str, Any]]) -> list[str]:
    """``spare_beside.py``: one run's steps with a spare importing beside it, and without."""
    cols = ["run", "config", "spares", "steps beside / alone", "tok/s beside", "tok/s alone"]
    cols += ["slowdown beside (95 % CI)"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    for run in runs:
        b = run.get("spare_beside")
        if not b or "error" in b:
            continue
        slow = b.get("slowdown")
        cell = f"{slow['overhead_pct']} % ({_interval(slow)})" if slow else "-"
        values = [run["_dir"], run["config"], len(run["windows"])]
        values += [f"{b['steps_beside']} / {b['steps_alone']}"]
        values += [_v(b["tokens_per_s_beside"]), _v(b["tokens_per_s_alone"]), cell]
        lines.append("| " + " | ".join(map(str, values)) + " |")
    return lines if len(lines) > 2 else []


def supervisor_rows(runs: list[dict[str, Any]]) -> list[str]:
    lines = [
        "| scenario | run | supervisor CPU (s) | supervisor peak RSS (MiB) | wall (s) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, info, _ in scenarios(runs):
        for r in info["rows"]:
            if r.get("supervisor_peak_rss"):
                rss = round(r["supervisor_peak_rss"] / MiB)
                cpu, wall = _v(r["supervisor_cpu_s"]), _v(r.get("wall_s"))
                lines.append(f"| {name} | {r['approach']} | {cpu} | {rss} | {wall} |")
    return lines


def overhead_rows(runs: list[dict[str, Any]]) -> list[str]:
    cols = ["scenario", "config", "order", "steps S / B", "supervised tok/s", "bare tok/s", "overhead"]
    cols += ["95 % CI", "run medians S", "run medians B", "steps beside a spare's imports"]
    cols += ["supervisor CPU (s)", "supervisor RSS (MiB)"]
    lines = ["| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
    found = [(name, o) for run in runs for name, o in (run.get("overhead") or {}).items()]
    for name, o in found:
        beside = o.get("beside_spare_imports") or {}
        steps = o.get("steps_measured") or {}
        values = [name, o["config"], " ".join(x[0].upper() for x in o["order"])]
        values += [f"{steps.get('supervised')} / {steps.get('bare')}"]
        values += [o["tokens_per_s_supervised"], o["tokens_per_s_bare"], f"{_v(o['overhead_pct'])} %"]
        values += [_interval(interval(o["run_medians_supervised"], o["run_medians_bare"]))]
        values += [", ".join(map(str, o[f"run_medians_{side}"])) for side in ("supervised", "bare")]
        values += [beside.get("steps", 0)]
        values += [", ".join(map(str, o["supervisor_cpu_s"]))]
        values += [", ".join(str(round((r or 0) / MiB)) for r in o["supervisor_peak_rss"])]
        lines.append("| " + " | ".join(map(str, values)) + " |")
    if len(found) > 1:
        for name, i in pooled(found).items():
            runs_text = f"{i['n'][0]} + {i['n'][1]} runs" if i else "-"
            pct = f"{i['overhead_pct']} %" if i else "-"
            lines.append(f"| {name}, pooled | | | {runs_text} | | | {pct} | {_interval(i)} |" + " |" * 5)
    return lines


def _interval(i: dict[str, Any] | None) -> str:
    return f"{i['low_pct']} to {i['high_pct']} %" if i else "-"


def provenance(runs: list[dict[str, Any]]) -> list[str]:
    lines = []
    for run in runs:
        stack = (run.get("versions") or {}).get("stack") or {}
        versions = ", ".join(f"{k} {v}" for k, v in stack.items()) or "not recorded"
        lines.append(
            f"- `{run['_dir']}`: started {run['started']}, device {run['device']}, Python {run['python']}, "
            f"qlora-supervise {run['qlora_supervise']}; {versions}; {run.get('total_s')} s"
        )
        lines.append(f"  - command: `{' '.join(run['command'])}` (in `{run['cwd']}`)")
    return lines


def results_md(runs: list[dict[str, Any]]) -> str:
    parts = [
        "# bench/recovery: OOM recovery side by side",
        "",
        "Written by `bench/recovery/report.py` from the `run.py` results listed below; every number",
        "is measured (the definitions are in `bench/recovery/measure.py`). Tokens/s of card commands",
        "that ran at the same time on one GPU are shares of it: compare them within one scenario;",
        "the overhead table was measured alone on the GPU.",
        "",
        "## Runs",
        "",
        *provenance(runs),
        "",
        "## Summary",
        "",
        *summary_table(runs),
        "",
        "## Targets",
        "",
        *targets.check(runs),
        "",
        "## Every approach",
        "",
        *full_rows(runs),
        "## OOM → next step",
        "",
        *recovery_rows(runs),
        "",
        "## The supervisor's own cost",
        "",
        *supervisor_rows(runs),
        "",
        "The same config supervised (a warm spare beside it) and bare, interleaved, alone on the GPU",
        "(`bench/recovery/overhead.py`):",
        "",
        *overhead_rows(runs),
        "",
        "A spare importing beside a warm-started attempt (it starts after that attempt's first step):",
        "the attempt's step times (including each step's checkpoint) while it imported and after.",
        "",
        *beside_rows(runs),
        "",
        "One uncapped run bare, with spares started beside it one after another",
        "(a one-off script, `bench/recovery/spare_beside.py`, since removed; git keeps it): its steps that",
        "completed while a spare imported, against",
        "those that completed while none did.",
        "",
        *spare_beside_rows(runs),
        "",
    ]
    return "\n".join(parts)


def replace_block(readme: Path, block: list[str]) -> bool:
    text = readme.read_text(encoding="utf-8")
    if START not in text or END not in text:
        return False
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + START + "\n" + "\n".join(block) + "\n" + END + tail, encoding="utf-8")
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dirs", nargs="+", type=Path, help="run.py --out directories")
    p.add_argument("--results", type=Path, default=Path(__file__).resolve().with_name("RESULTS.md"))
    p.add_argument("--readme", type=Path, help="a page with the bench-recovery markers (docs/recovery.md)")
    args = p.parse_args(argv)
    runs = load(args.dirs)
    args.results.write_text(results_md(runs), encoding="utf-8")
    summary = [*summary_table(runs), "", *recovery_rows(runs), "", *targets.check(runs)]
    if args.readme and not replace_block(args.readme, summary):
        raise SystemExit(f"{args.readme}: no {START} ... {END} block to replace")
    print("\n".join(summary))
    print(f"wrote {args.results}" + (f" and the summary in {args.readme}" if args.readme else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
