"""Recovery side by side: qlora-supervise, a restart loop and ``auto_find_batch_size`` on one card size.

    python -m bench.recovery.run --build-only [--cache DIR]              # models + data, once (GPU)
    python -m bench.recovery.run --card 8GiB --out OUT [--cache DIR] [--deadline-s 540]
    python -m bench.recovery.run --card 24GiB --overhead --out OUT       # supervised vs bare tokens/s
    python -m bench.recovery.run --tiny --card all --out /tmp/r          # the same logic on the CPU

On the H200 (from the project root, after bench/README.md's ``.whl`` preamble), commands of under
10 minutes each: the four cards at once, sharing the built models (~9 min, ``--deadline-s``
bounds each); one card alone (the recovery times without neighbours); the overhead, alone
(3 supervised/bare pairs, ~6.5 min; run it twice and ``report.py`` pools the runs)::

    python -m bench.recovery.run --build-only
    R=$OUT/recovery; mkdir -p $R; for c in 8GiB 16GiB 24GiB 32GiB; do
      python -m bench.recovery.run --card $c --out $R/$c --deadline-s 540 > $R/$c.log 2>&1 &
    done; wait; cat $R/*/table.txt
    python -m bench.recovery.run --card 8GiB --approaches as-written as-written-no-spare \
      --max-steps 6 --deadline-s 260 --out $OUT/solo/8GiB
    python -m bench.recovery.run --card 24GiB --overhead --overhead-pairs 3 --overhead-steps 12 \
      --deadline-s 560 --out $OUT/overhead-a

Per card, each scenario of :mod:`recovery.scenarios` (an over-ambitious job on the 7B or 8B shape
under ``gpu_memory_limit``) runs under every approach of :mod:`recovery.approaches`, one after
another, each within a time limit carved from ``--deadline-s`` so that a slow approach still
leaves time (and partial results) for the rest. Writes ``OUT/results.json`` (every number, the
command, versions, device), ``OUT/table.txt`` (printed last) and ``OUT/<scenario>/<approach>/``
(the run directory's journals, no checkpoints: ``qlora-supervise explain`` reads them, with
``--model-config OUT/<scenario>/model-config.json``). ``bench/recovery/report.py OUT...`` turns
one or more OUT directories into RESULTS.md and the summary table of docs/recovery.md.

Concurrency: card commands running together share the GPU's compute (the memory caps keep their
memory apart), so their tokens/s and step times are each a share of the card and are comparable
only within one card command (the same neighbours for every approach, roughly); each block says
how many other card commands ran beside it. The overhead (supervised against bare tokens/s) is
measured alone on the GPU with ``--overhead``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import platform
import shutil
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from . import approaches, assets, outcomes, table
from .approaches import Place
from .keep import keep_journals
from .launch import Neighbours
from .overhead import measure_overhead
from .scenarios import UNCAPPED, Scenario, for_card, steady

ROOT = Path(__file__).resolve().parents[2]
#: Below this an approach is not started (an attempt alone takes ~20 s on the H200, 10 s on the CPU).
MIN_APPROACH_S = {False: 45.0, True: 20.0}
END_MARGIN_S = 15.0  # reading, copying and the table after the last approach


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--card", help="the card size of the scenarios to run (8GiB, 16GiB, 24GiB, 32GiB; all)")
    p.add_argument("--out", type=Path, help="results directory")
    p.add_argument("--cache", type=Path, help="models and data (default build/recovery-cache[-tiny])")
    p.add_argument("--runs", type=Path, help="run directories (default: CACHE/runs/CARD)")
    p.add_argument("--deadline-s", type=float, default=540.0, help="wall-clock budget of this command")
    p.add_argument("--approach-max-s", type=float, default=240.0, help="the most one approach may take")
    p.add_argument(
        "--approaches", nargs="+", choices=approaches.APPROACHES, default=list(approaches.APPROACHES)
    )
    p.add_argument("--scenarios", nargs="+", help="only these scenarios of the card (names)")
    p.add_argument("--max-steps", type=int, help="steps of every scenario (default: each its own)")
    p.add_argument("--restarts", type=int, default=approaches.RESTARTS, help="the restart loop's restarts")
    p.add_argument("--build-only", action="store_true", help="build the models and data, then stop")
    p.add_argument("--overhead", action="store_true", help="supervised vs bare tokens/s of each scenario")
    p.add_argument("--overhead-steps", type=int, default=12, help="steps of each overhead run")
    p.add_argument("--overhead-pairs", type=int, default=3, help="supervised/bare pairs")
    p.add_argument("--tiny", action="store_true", help="the CPU check: tiny shapes, cpu_memory_limit cards")
    args = p.parse_args(argv)
    if not args.build_only and (args.card is None or args.out is None):
        p.error("--card and --out are needed (or --build-only)")
    args.cache = args.cache or ROOT / "build" / ("recovery-cache-tiny" if args.tiny else "recovery-cache")
    args.runs = args.runs or args.cache / "runs" / (args.card or "all")
    return args


def device_name(tiny: bool) -> str:
    if tiny:
        return f"cpu ({platform.processor() or platform.machine()})"
    try:
        import pynvml

        pynvml.nvmlInit()
        name = str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)))
        pynvml.nvmlShutdown()
        return name
    except Exception as error:  # a bench records what it could not read and goes on
        return f"unknown ({type(error).__name__})"


class Budget:
    """Time limits carved from the deadline (counted from the command's start, building included):
    each run gets what is left less the minimum of every run still to come, at most ``cap``; None
    when even its own minimum is not left."""

    def __init__(self, end: float, cap: float, minimum: float, runs: int) -> None:
        self.end = end - END_MARGIN_S
        self.cap, self.minimum, self.left_runs = cap, minimum, runs

    def next(self) -> float | None:
        self.left_runs -= 1
        limit = min(self.cap, self.end - time.monotonic() - self.minimum * self.left_runs)
        return limit if limit >= self.minimum else None


class Bench:
    """One card command: its results document, saved after every run."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        args.out.mkdir(parents=True, exist_ok=True)
        self.results: dict[str, Any] = {
            "command": [sys.executable, *sys.argv],
            "cwd": str(Path.cwd()),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "host": platform.node(),
            "python": platform.python_version(),
            "qlora_supervise": _version(),
            "device": device_name(args.tiny),
            "tiny": args.tiny,
            "card": args.card,
            "scenarios": {},
        }
        self.lines: list[str] = []

    def save(self) -> None:
        (self.args.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str), "utf-8")
        (self.args.out / "table.txt").write_text("\n".join(self.lines) + "\n", encoding="utf-8")

    def place(self, s: Scenario) -> Place:
        keep = self.args.out / s.name
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.args.cache / s.shape / "model" / "config.json", keep / "model-config.json")
        return Place(s, self.args.cache / s.shape, self.args.runs / s.name, keep, self.args.tiny)


def run_approach(
    place: Place, approach: str, limit: float, restarts: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run one approach; (its raw output, its result row)."""
    s = place.scenario
    if approach == "restart-loop":
        out = approaches.restart_loop(place, limit, restarts)
        return out, outcomes.restart_loop(s, out)
    if approach == "auto-batch":
        out = approaches.auto_batch(place, limit)
        return out, outcomes.auto_batch(s, out)
    out = approaches.supervised(place, approach, limit)
    if "skipped" in out:
        return out, {"approach": approach, "skipped": out["skipped"]}
    return out, outcomes.supervised(s, approach, out)


def guarded_run(
    place: Place, approach: str, limit: float, restarts: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`run_approach`, where a fault of the bench itself (a file it cannot read) costs this
    one row, not the card's other runs: the row says what went wrong, the traceback goes to stdout."""
    try:
        return run_approach(place, approach, limit, restarts)
    except Exception as error:  # a bench records what went wrong and goes on
        traceback.print_exc()
        return {}, {"approach": approach, "skipped": f"bench error: {type(error).__name__}: {error}"[:300]}


def finish_run(place: Place, approach: str, out: dict[str, Any]) -> None:
    """Keep the journals, drop the run directory (its checkpoints are not needed any more)."""
    run_dir = Path(out.get("run_dir") or place.runs / approach)
    if run_dir.is_dir():
        keep_journals(run_dir, place.keep / approach)
        shutil.rmtree(run_dir, ignore_errors=True)


def long_row_note(s: Scenario, rows: list[dict[str, Any]], keep: Path) -> str | None:
    """Where the long row was put and where the as-written run's first OOM came (the check)."""
    if s.long_row_step is None:
        return None
    error = keep / "as-written" / "attempt-001" / "error.json"
    came = json.loads(error.read_text(encoding="utf-8")).get("step", -1) + 1 if error.is_file() else None
    return f"long row placed in step {s.long_row_step}; as-written attempt 1 failed in step {came or '-'}"


def chosen(args: argparse.Namespace) -> list[Scenario]:
    """The card's scenarios, or those of them ``--scenarios`` names."""
    found = for_card(args.card or "all", args.tiny)
    if args.scenarios:
        unknown = set(args.scenarios) - {s.name for s in found}
        if unknown:
            raise SystemExit(
                f"--scenarios {sorted(unknown)}: not on this card; it has {[s.name for s in found]}"
            )
        found = [s for s in found if s.name in args.scenarios]
    if args.max_steps:
        found = [dataclasses.replace(s, max_steps=args.max_steps) for s in found]
    return found


def card(bench: Bench, neighbours: Neighbours) -> None:
    args = bench.args
    scenarios = chosen(args)
    runs = len(scenarios) * len(args.approaches)
    budget = Budget(args.end, args.approach_max_s, MIN_APPROACH_S[args.tiny], runs)
    for s in scenarios:
        place = bench.place(s)
        info: dict[str, Any] = {
            "card": s.card,
            "shape": s.shape,
            "written": s.written(),
            "max_steps": s.max_steps,
        }
        info |= {"scenario": dataclasses.asdict(s), "rows": [], "raw": {}, "alongside": 0}
        began = time.time()
        bench.results["scenarios"][s.name] = info
        for approach in args.approaches:
            limit = budget.next()
            if limit is None:
                info["rows"].append({"approach": approach, "skipped": "no time left within --deadline-s"})
                continue
            print(f"{s.name}: {approach} (limit {limit:.0f} s) ...", flush=True)
            out, result = guarded_run(place, approach, limit, args.restarts)
            info["raw"][approach], result["limit_s"] = out, round(limit)
            info["rows"].append(result)
            info["alongside"] = neighbours.overlapping(began, time.time())
            finish_run(place, approach, out)
            info["long_row_note"] = long_row_note(s, info["rows"], place.keep)
            bench.lines = [
                line
                for name, i in bench.results["scenarios"].items()
                for line in table.scenario_block(name, i)
            ]
            bench.save()


def overhead(bench: Bench) -> None:
    """Each scenario's job uncapped, supervised and bare in turn, alone (:mod:`recovery.overhead`)."""
    args = bench.args
    results: dict[str, Any] = {}
    bench.results["overhead"] = results
    runs = 2 * args.overhead_pairs * len(chosen(args))
    budget = Budget(args.end, (args.deadline_s - END_MARGIN_S) / runs, MIN_APPROACH_S[args.tiny], runs)
    for base in chosen(args):
        s = steady(base, "overhead", args.overhead_steps)
        place = bench.place(s)
        print(f"{s.name}: {args.overhead_pairs} supervised/bare pairs ...", flush=True)
        found = measure_overhead(place, args.overhead_pairs, budget)
        for name, out in found.pop("_dirs"):
            finish_run(place, name, out)
        results[s.name] = found | {"written": s.written(), "steps": s.max_steps}
        bench.lines = table.overhead_block(results)
        bench.save()


def versions(out: Path) -> dict[str, Any]:
    """The training stack's versions and the device, as a trainer child reported them."""
    for path in sorted(out.glob("*/*/attempt-*/child-events.jsonl")):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            if '"started"' in line:
                event = json.loads(line)
                return {"stack": event.get("versions"), "device_name": event.get("device_name")}
    return {}


def _version() -> str:
    try:
        return importlib.metadata.version("qlora-supervise")
    except importlib.metadata.PackageNotFoundError:
        return "not installed (source tree)"


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    start = time.monotonic()
    args.end = start + args.deadline_s
    scenarios = chosen(args)
    if args.overhead:
        scenarios = [dataclasses.replace(s, long_row_step=None, card=UNCAPPED) for s in scenarios]
    built = assets.ensure_assets(args.cache, scenarios, args.tiny)
    if args.build_only:
        print(f"assets in {args.cache} ({time.monotonic() - start:.0f} s): {json.dumps(built)}")
        return 0
    bench = Bench(args)
    bench.results["build"] = built
    neighbours = Neighbours(args.cache, args.card)
    try:
        if args.overhead:
            overhead(bench)
        else:
            card(bench, neighbours)
    finally:
        neighbours.leave()
    bench.results["versions"] = versions(args.out)
    bench.results["total_s"] = round(time.monotonic() - start, 1)
    bench.lines.append(
        f"total {bench.results['total_s']} s; device {bench.results['device']}; {args.out}/results.json"
    )
    bench.save()
    print("\n".join(bench.lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
