"""Does a spare importing the stack slow the trainer beside it? One run, its steps compared.

    python bench/recovery/spare_beside.py --out OUT/spare-beside [--steps 24] [--cache DIR] [--tiny]

A spare imports the stack while an attempt trains whenever it stands behind a warm-started one
(it starts after that attempt's first step). Between runs the card's speed differs by more
than such an effect could be (bench/recovery/overhead.py), so this compares steps *within* one
run: the trainer child runs bare, uncapped, saving only at the end (the overhead scenario's
job), and beside it spares are started one after another from the product's own
``trainer_child.spare`` (with ``--prepare``, as the supervisor starts them), each one left
to import and prepare, then sent away, then a pause as long as its import before the next. The
steps that completed while a spare imported are set against those that completed while none
did (the first step left out: warm-up); the difference is the slowdown a spare's imports
cause, with a 95 % interval from the two groups' steps (Welch's t).

Writes ``OUT/results.json`` (``spare_beside``: the windows, every step, the comparison) and
``OUT/table.txt``; ``report.py`` includes it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_ladder
from recovery import assets, jobs
from recovery.approaches import attempt_env, write_spec
from recovery.keep import keep_journals
from recovery.measure import step_log
from recovery.overhead import Steps, interval, split_by_windows, steps_of
from recovery.scenarios import SCENARIOS, TINY_SCENARIOS, steady

from qlora_supervise.supervisor.loop.child import ChildProcess

ROOT = Path(__file__).resolve().parents[2]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--cache", type=Path, help="models and data (default build/recovery-cache[-tiny])")
    p.add_argument("--steps", type=int, default=24, help="optimizer steps of the trainer")
    p.add_argument("--tiny", action="store_true", help="the CPU check: the tiny stand-in shape")
    p.add_argument("--limit-s", type=float, default=420.0, help="the trainer's time limit")
    args = p.parse_args(argv)
    args.cache = args.cache or ROOT / "build" / ("recovery-cache-tiny" if args.tiny else "recovery-cache")
    return args


def heartbeat_step(events: Path) -> int:
    """The newest completed step in a child's events file (0 before the first)."""
    return max(step_log(gpu_ladder.read_jsonl(events))[0], default=0)


def cycle_spares(
    child: ChildProcess, spec_path: Path, env: dict[str, str], run_dir: Path, device: str
) -> list[Any]:
    """Spares one after another beside ``child`` from its first step until it exits: each imports
    and prepares, then gets an empty order (it leaves), then a pause as long as it took."""
    from qlora_supervise.supervisor.loop import child as child_mod
    from qlora_supervise.supervisor.loop.spare import SpareOrder, ready_line, spare_argv

    events = Path(json.loads(spec_path.read_text(encoding="utf-8"))["events_file"])
    while child.poll() is None and heartbeat_step(events) < 1:
        time.sleep(0.2)
    knobs = json.loads(spec_path.read_text(encoding="utf-8"))["knobs"]
    order = SpareOrder(env, device, knobs["expandable_segments"], knobs["model"], prepare_from=spec_path)
    windows = []
    log = run_dir / "spare.log"
    while child.poll() is None:
        spare = child_mod.spawn_spare(spare_argv(run_dir, order, sys.executable), env, log, run_dir)
        began = time.time()
        while child.poll() is None and (ready := ready_line(log, spare.pid)) is None:
            time.sleep(0.1)
        ended = time.time()
        spare.stop(5.0)
        if child.poll() is not None:
            break
        windows.append({"start": began, "end": ended, "import_s": (ready or {}).get("import_s")})
        time.sleep(ended - began)
    return windows


def compare(steps: Steps, windows: list[dict[str, Any]]) -> dict[str, Any]:
    """The steps beside an import against the steps alone: medians, and the mean's difference
    with Welch's interval (the steps of one run are neighbours, not independent samples: the
    interval is narrower than the truth, and the report does not judge the target on it)."""
    spans = [(w["start"], w["end"]) for w in windows]
    inside, outside = split_by_windows(steps.rates, steps.ended, spans, steps.began)
    found = interval(inside, outside)
    return {
        "steps_beside": len(inside),
        "steps_alone": len(outside),
        "tokens_per_s_beside": round(statistics.median(inside), 1) if inside else None,
        "tokens_per_s_alone": round(statistics.median(outside), 1) if outside else None,
        "slowdown": found,  # overhead_pct: how much slower steps beside an import are, in %
    }


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    name = "tiny-7b-card" if args.tiny else "7b-24GiB-long-row"  # the overhead runs' scenario
    base = next(x for x in (TINY_SCENARIOS if args.tiny else SCENARIOS) if x.name == name)
    s = steady(base, "spare-beside", args.steps)
    assets.ensure_assets(args.cache, [s], args.tiny)
    run_dir = args.cache / "runs" / "spare-beside"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: events files are appended to
    job = jobs.write_job(s, args.cache / s.shape, run_dir, args.tiny)
    spec = jobs.placed(jobs.job_spec(job), run_dir, 1, None)
    spec_path = write_spec(spec)
    env = attempt_env(spec.to_json())

    from qlora_supervise.supervisor.loop import child as child_mod

    started = time.time()
    child = child_mod.spawn_child(
        child_mod.child_argv(spec_path, "train"), env, spec_path.with_name("child.log"), run_dir
    )
    windows = cycle_spares(child, spec_path, env, run_dir, spec.device)
    try:
        code = child.popen.wait(timeout=max(1.0, args.limit_s - (time.time() - started)))
    finally:
        if child.poll() is None:
            child.stop(20.0)
    steps = steps_of(run_dir, "bare", "bare")
    from recovery.run import _version, device_name

    started_event = next(
        (e for e in gpu_ladder.read_jsonl(Path(spec.events_file)) if e.get("event") == "started"), {}
    )
    result = {
        "command": [sys.executable, *sys.argv],
        "cwd": str(Path.cwd()),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "python": platform.python_version(),
        "device": device_name(args.tiny),
        "qlora_supervise": _version(),
        "versions": {"stack": started_event.get("versions")},
        "total_s": round(time.time() - started, 1),
        "exit_code": code if child.poll() is not None else None,
        "config": f"{s.written()} ({s.max_steps} steps, uncapped)",
        "windows": windows,
        "steps": dataclasses.asdict(steps) if steps else None,
        "spare_beside": compare(steps, windows) if steps else {"error": "no step completed"},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    keep_journals(run_dir, args.out / "run")
    (args.out / "results.json").write_text(json.dumps(result, indent=1, default=str), encoding="utf-8")
    line = f"spare beside: {json.dumps(result['spare_beside'])}; {len(windows)} spares"
    line += f"; exit {result['exit_code']}"
    (args.out / "table.txt").write_text(line + "\n", encoding="utf-8")
    print(line, flush=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
