"""The fault benchmark: the real supervisor under random faults, run after run, and what survived.

    python bench/faults.py --runs 35 --seed 1 [--real 2] [--out bench/results/faults-DATE]

Each run supervises a fresh job and injects one scenario's faults at random moments:

* ``child_kill`` - SIGKILL of the trainer child mid-run (an operator's kill, a preemption);
* ``child_kill_in_save`` - SIGKILL of the child while it writes a checkpoint;
* ``supervisor_kill`` - SIGKILL of the supervisor alone (its child is reclaimed by the next one);
* ``both_kill`` - SIGKILL of the supervisor and the child together;
* ``sigterm`` - SIGTERM of the supervisor (a graceful stop; the child checkpoints first);
* ``sigstop_hang`` - SIGSTOP of the child: a hang the supervisor must detect and end;
* ``disk_full`` - the run's disk (a real 8 MiB tmpfs) filled to its last byte, freed later;
* ``corrupt_newest`` - the newest complete checkpoint's adapter file damaged after a child kill;
* ``job_change`` - the supervisor stopped, ``max_steps`` raised in the job, the same command again.

After each fault that ended the supervisor, the *same command* is run again, as systemd would.
The scripted child (``tests/scripted_child.py``, the real protocol without torch) keeps runs to
seconds; ``--real N`` adds N runs of the real trainer on the tiny model (child and supervisor kills).

Per run it records: whether the run finished (exit 0, the adapter, every step), the kills,
lost steps split into *inherent* (steps after the newest checkpoint that was complete when the
attempt ended) and *avoidable* (a resume from older than that), corrupt states (state.json or a
journal line unreadable, or a resume from an incomplete or damaged checkpoint) and tracebacks in
the supervisor's output. Targets: 100 % finished, 0 avoidable lost steps, 0 corrupt states, 0
tracebacks.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from _fault_harness import REAL_STEPS, SAVE_STEPS, STEPS, Harness, Run, fill_disk, newest_complete  # noqa: E402
from _fault_measure import measure  # noqa: E402 - the bench folder is not a package

# -- the scenarios: each injects its faults and leaves the supervisor running or ended -------


def child_kill(h: Harness, run: Run) -> None:
    for _ in range(h.rng.randint(1, 2)):
        if h.after_random_progress() and h.kill(h.child_pid()):
            run.kills += 1
            time.sleep(0.3)
    h.to_the_end(run)


def child_kill_in_save(h: Harness, run: Run) -> None:
    if h.until(h.child_running) and h.until(h.saving, timeout=30):
        time.sleep(h.rng.uniform(0.0, 0.1))
        run.kills += int(h.kill(h.child_pid()))
    h.to_the_end(run)


def supervisor_kill(h: Harness, run: Run) -> None:
    if h.after_random_progress():
        assert h.proc is not None
        h.proc.kill()
        run.kills += 1
    h.to_the_end(run)


def both_kill(h: Harness, run: Run) -> None:
    if h.after_random_progress():
        assert h.proc is not None
        child = h.child_pid()
        h.proc.kill()
        run.kills += 1 + int(h.kill(child))
    h.to_the_end(run)


def sigterm(h: Harness, run: Run) -> None:
    if h.after_random_progress():
        assert h.proc is not None
        h.proc.send_signal(signal.SIGTERM)
        run.kills += 1
    h.to_the_end(run)


def sigstop_hang(h: Harness, run: Run) -> None:
    if h.after_random_progress() and h.kill(h.child_pid(), signal.SIGSTOP):
        run.kills += 1
    h.to_the_end(run)


def disk_full(h: Harness, run: Run) -> None:
    if h.mount is None:
        run.note = "no tmpfs (needs root): not run"
        h.to_the_end(run)
        return
    if h.after_random_progress():
        filler = h.mount / "filler.bin"
        fill_disk(filler)
        run.kills += 1
        time.sleep(h.rng.uniform(0.5, 2.0))
        filler.unlink()
    h.to_the_end(run)


def corrupt_newest(h: Harness, run: Run) -> None:
    if h.after_random_progress() and h.until(lambda: newest_complete(h.run_dir) is not None, 30):
        child = h.child_pid()
        if h.kill(child, signal.SIGSTOP):
            newest = newest_complete(h.run_dir)
            assert newest is not None
            target = newest / "adapter.bin"
            target.write_bytes(target.read_bytes()[: max(1, target.stat().st_size // 2)])
            h.damaged.append(str(newest))
            h.kill(child, signal.SIGKILL)
            run.kills += 1
    h.to_the_end(run)


def job_change(h: Harness, run: Run) -> None:
    global_steps = STEPS + 4
    if h.after_random_progress():
        assert h.proc is not None
        h.proc.send_signal(signal.SIGTERM)
        run.kills += 1
        run.exits.append(h.wait_exit())
        h.edit_job(max_steps=global_steps)
        h.start()
    h.to_the_end(run)
    run.note = f"max_steps {STEPS} -> {global_steps}"


SCENARIOS: dict[str, Callable[[Harness, Run], None]] = {
    f.__name__: f
    for f in (
        child_kill,
        child_kill_in_save,
        supervisor_kill,
        both_kill,
        sigterm,
        sigstop_hang,
        disk_full,
        corrupt_newest,
        job_change,
    )
}
REAL_SCENARIOS = ("child_kill", "supervisor_kill", "sigterm")


KEEP_OUT = shutil.ignore_patterns("checkpoints*", "adapter", "*.bin", "*.pt", "*.safetensors")


def one_run(name: str, seed: int, real: bool, tiny: Path | None, keep: Path | None) -> Run:
    rng = random.Random(seed)
    run = Run(name, seed, real)
    work = Path(tempfile.mkdtemp(prefix=f"fault-{name}-"))
    h = Harness(work, rng, real, tiny if real else None)
    started = time.monotonic()
    try:
        if name == "disk_full":
            h.on_small_disk()
            h.env["SCRIPTED_CHILD_CKPT_BYTES"] = str(256 * 1024)
        if name == "child_kill_in_save":
            h.env["SCRIPTED_CHILD_SAVE_S"] = "0.15"
        h.start()
        SCENARIOS[name](h, run)
        run.wall_s = time.monotonic() - started
        steps = REAL_STEPS if real else STEPS + (4 if name == "job_change" else 0)
        measure(run, h.run_dir, h.stderr, h.damaged, steps, SAVE_STEPS)
        if keep is not None and not met_targets(run):  # the run directory of each miss, to read
            shutil.copytree(h.run_dir, keep / f"{name}-{seed}", ignore=KEEP_OUT)
    finally:
        h.close()
        shutil.rmtree(work, ignore_errors=True)
    return run


def met_targets(run: Run) -> bool:
    return run.finished and not run.corrupt and not run.tracebacks and not run.lost_avoidable


def table(runs: list[Run]) -> str:
    """The per-scenario table and the totals against the targets (Markdown)."""
    lines = [
        "| scenario | runs | faults | finished | lost inherent | lost avoidable | corrupt | tracebacks |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.scenario + (" (real trainer)" if r.real else ""), []).append(r)
    for name, rs in [*groups.items(), ("**all**", runs)]:
        lines.append(
            f"| {name} | {len(rs)} | {sum(r.kills for r in rs)} | {sum(r.finished for r in rs)}/{len(rs)} | "
            f"{sum(r.lost_inherent for r in rs)} | {sum(r.lost_avoidable for r in rs)} | "
            f"{sum(len(r.corrupt) for r in rs)} | {sum(r.tracebacks for r in rs)} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=36, help="scripted-child runs (scenarios in turn)")
    parser.add_argument(
        "--real", type=int, default=0, help="extra runs of the real trainer on the tiny model"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", choices=sorted(SCENARIOS), help="run one scenario only")
    parser.add_argument(
        "--out", type=Path, help="write results.json, table.md and the misses' run directories here"
    )
    args = parser.parse_args()
    names = [args.only] if args.only else list(SCENARIOS)
    plan = [(names[i % len(names)], args.seed * 1000 + i, False) for i in range(args.runs)]
    plan += [
        (REAL_SCENARIOS[i % len(REAL_SCENARIOS)], args.seed * 1000 + 500 + i, True) for i in range(args.real)
    ]
    tiny = _make_tiny(Path(tempfile.mkdtemp(prefix="fault-tiny-"))) if args.real else None
    keep = args.out / "runs" if args.out else None
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    runs = []
    for name, seed, real in plan:
        run = one_run(name, seed, real, tiny, keep)
        runs.append(run)
        flag = "ok " if met_targets(run) else "BAD"
        print(
            f"{flag} {name:<20} seed {seed} exits {run.exits} lost {run.lost_inherent}+{run.lost_avoidable} "
            f"{'corrupt ' + ','.join(run.corrupt) if run.corrupt else ''} {run.note} ({run.wall_s:.1f}s)",
            flush=True,
        )
    elapsed = time.monotonic() - started
    text = table(runs) + f"\n\n{len(runs)} runs in {elapsed:.0f} s"
    print("\n" + text)
    if args.out:
        (args.out / "results.json").write_text(json.dumps([asdict(r) for r in runs], indent=2))
        (args.out / "table.md").write_text(text + "\n")
    return 0 if all(met_targets(r) for r in runs) else 1


def _make_tiny(directory: Path) -> Path:
    subprocess.run(
        [sys.executable, "-m", "qlora_supervise.supervisor.commands.cli", "make-tiny", str(directory)],
        check=True,
        capture_output=True,
    )
    return directory


if __name__ == "__main__":
    sys.exit(main())
