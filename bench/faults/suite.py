"""The fault benchmark: the real supervisor under random faults, run after run, and what survived.

    python -m bench.faults.suite --runs 35 --seed 1 [--real 2] [--out bench/results/faults-DATE]

Each run supervises a fresh job and injects one scenario's faults at random moments:

* ``child_kill`` - SIGKILL of the trainer child mid-run (an operator's kill, a preemption);
* ``child_kill_in_save`` - SIGKILL of the child while it writes a checkpoint;
* ``supervisor_kill`` - SIGKILL of the supervisor alone (its child is reclaimed by the next one);
* ``both_kill`` - SIGKILL of the supervisor and the child together;
* ``sigterm`` - SIGTERM of the supervisor (a graceful stop; the child checkpoints first);
* ``sigstop_hang`` - SIGSTOP of the child: a hang the supervisor must detect and end;
* ``disk_full`` - the run's disk (a real 8 MiB tmpfs) filled to its last byte, freed later;
* ``corrupt_newest`` - the newest complete checkpoint's adapter file damaged after a child kill;
* ``job_change`` - the supervisor stopped, ``max_steps`` raised in the job, the same command again;
* ``metrics_unwritable`` - the ``metrics_textfile``'s folder turned into a regular file mid-run and
  back (issue 21 item 1): a step must be trained meanwhile;
* ``metrics_uncreatable`` - a ``metrics_textfile`` that cannot be created from the start (item 2):
  trained without it, or refused in words (exit 2) and trained once the field is removed;
* ``planted_link`` - a planted ``checkpoints`` or ``checkpoints/checkpoint-N`` symlink to a folder
  outside the run (item 3): nothing may be written through it;
* ``host_oom_kill`` - ``oom_kill`` counted in a cgroup ``memory.events``, then SIGKILL after
  progress (item 4): recorded at its heartbeat's stage, retried unchanged once;
* ``peak_store_race`` - two processes recording 150 peaks each in one peak store (item 9): 300 kept;
* ``extend_finished`` - a finished run, ``max_steps`` raised, the same command (item 13): it trains on
  from its newest checkpoint (half the time with a child kill during the extension);
* ``spare_sigstop`` (real trainer only) - the ready warm spare SIGSTOPped, then the child killed
  (item 5): the stopped spare is discarded in seconds and the next attempt trains cold;
* issue 29's, at the edges (``edges.py``): ``foreign_output_dir``, ``planted_entry_link``,
  ``merge_beside_run``, ``bounded_input``, ``loud_hook``, ``unparsed_tool_value``, ``refused_words``;
* issue 29's, of the tools (``tools.py``): ``tool_refusal``, ``host_kills_apart``, ``ctrl_c_tee``,
  ``extend_schedule`` (real trainer only).

After each fault that ended the supervisor, the *same command* is run again, as systemd would.
The scripted child (``tests/scripted_child.py``, the real protocol without torch) keeps runs to
seconds; ``--real N`` adds N runs of the real trainer on the tiny model (child and supervisor kills).

Per run it records: whether the run finished (exit 0, the adapter, every step), the kills,
lost steps split into *inherent* (steps after the newest checkpoint that was complete when the
attempt ended) and *avoidable* (a resume from older than that), corrupt states (state.json or a
journal line unreadable, or a resume from an incomplete or damaged checkpoint) and tracebacks in
the supervisor's output, paths that appeared under the run's temp folder outside the run directory
(the configured textfile's folder and the peak store excepted; a planted link's target is inside
the temp folder, so a write through it counts), and each scenario's own checks (*other misses*).
Targets: 100 % finished, 0 avoidable lost steps, 0 corrupt states, 0 tracebacks, 0 writes outside
the run, 0 misses. ``--runs 45 --real 4`` took about 20 minutes on the loaded 2-core machine.
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

from qlora_supervise.supervisor.record.journal import read_attempts

from . import edges, tools
from .harness import REAL_STEPS, SAVE_STEPS, STEPS, Harness, Run, fill_disk, newest_complete
from .measure import measure

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


# -- issue 21's faults ---------------------------------------------------------------------


def metrics_unwritable(h: Harness, run: Run) -> None:
    """Item 1: the metrics textfile's folder becomes a regular file mid-run (ENOTDIR even for
    root), then comes back; training must go on meanwhile."""
    folder = h.work / "metrics"
    if h.after_random_progress():
        aside = h.work / "metrics-aside"
        folder.rename(aside)
        folder.write_text("not a folder any more\n")
        run.kills += 1
        before, deadline = h.newest_step(), time.monotonic() + 1.5
        assert h.proc is not None
        while time.monotonic() < deadline and h.newest_step() == before and h.proc.poll() is None:
            time.sleep(0.05)
        if h.newest_step() == before and h.proc.poll() is None:
            run.misses.append("no step trained while the metrics textfile was unwritable")
        folder.unlink()
        aside.rename(folder)
    h.to_the_end(run)


def metrics_uncreatable(h: Harness, run: Run) -> None:
    """Item 2: a metrics textfile whose folder is a regular file from the start. Either the run
    trains without it (best-effort) or refuses at start in words (exit 2) and, with the field
    removed, trains; never a traceback or a restart loop."""
    code = h.wait_exit()
    run.exits.append(code)
    run.kills += 1
    if code == 2:
        run.note = "refused at start (exit 2); rerun without the textfile"
        h.edit_supervise(metrics_textfile=None)
        h.start()
        code = None
    h.to_the_end(run, first_exit=code)


def planted_link(h: Harness, run: Run) -> None:
    """Item 3: a planted ``checkpoints`` or ``checkpoints/checkpoint-N`` symlink to a folder
    outside the run. Refused in words (exit 2, then the link removed and the same command) or
    left alone; nothing may be written through it."""
    code = h.wait_exit()
    run.exits.append(code)
    run.kills += 1
    if code == 2:
        run.note += "; refused at start (exit 2), link removed"
        for link in (h.run_dir / "checkpoints", h.run_dir / "checkpoints" / f"checkpoint-{SAVE_STEPS}"):
            if link.is_symlink():
                link.unlink()
        h.start()
        code = None
    h.to_the_end(run, first_exit=code)


def host_oom_kill(h: Harness, run: Run) -> None:
    """Item 4: the kernel's OOM killer after progress: ``oom_kill`` counted in memory.events, then
    SIGKILL. The attempt is recorded at its heartbeat's stage and retried unchanged once."""
    events = h.work / "memory.events"
    if h.after_random_progress():
        events.write_text("low 0\nhigh 0\nmax 0\noom 1\noom_kill 1\n")
        if h.kill(h.child_pid()):
            run.kills += 1
    h.to_the_end(run)
    records, _ = read_attempts(h.run_dir / "attempts.jsonl")
    killed = next((r for r in records if r.failure and r.failure.kind.value == "host_oom"), None)
    if run.kills and killed is None:
        run.misses.append("the OOM kill was not classified host_oom")
    elif killed is not None and killed.steps_progressed > 0:
        if killed.failure is not None and killed.failure.stage.value == "unknown":
            run.misses.append("host OOM kill recorded with stage unknown")
        if killed.decision is None or killed.decision.rung != "retry_unchanged":
            run.misses.append(f"host OOM kill after progress moved the ladder ({killed.decision})")


def spare_sigstop(h: Harness, run: Run) -> None:
    """Item 5 (real trainer): the warm spare SIGSTOPped, then the child killed, so that the next
    attempt is handed to the stopped spare. It must be discarded in seconds and a cold child
    start: the next attempt trains within two minutes, not after the hang timeout (5 min here)."""
    spare = h.until(lambda: h.ready_spare() is not None, timeout=300) and h.ready_spare()
    if spare and h.until(h.child_running, timeout=300):
        h.kill(spare, signal.SIGSTOP)
        h.strays.append(spare)
        killed_attempt = h.newest_attempt()
        if h.kill(h.child_pid()):
            run.kills += 1
            started = time.monotonic()
            moved = h.until(lambda: h.newest_attempt() > killed_attempt and h.child_running(), timeout=150)
            waited = time.monotonic() - started
            run.note = f"next attempt trained {waited:.0f} s after the kill"
            if not moved:
                run.misses.append(
                    "the attempt after the kill did not train within 150 s (stopped spare used?)"
                )
    else:
        run.note = "no ready spare seen"
        run.misses.append("no warm spare reported ready")
    h.to_the_end(run)


def peak_store_race(h: Harness, run: Run) -> None:
    """Item 9: two processes record 150 peaks each into one peak store while the run goes on;
    all 300 lines must be there."""
    store = h.work / "state"
    writers = [subprocess.Popen([sys.executable, "-c", PEAK_WRITER, str(store), str(i)]) for i in range(2)]
    for writer in writers:
        writer.wait(timeout=300)
    run.kills += 2
    from qlora_supervise.policies.memory_model import ModelShape
    from qlora_supervise.supervisor.record.peak_store import read_observations

    shape = ModelShape(hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128, vocab=256)
    kept = len(read_observations(store / "peaks.jsonl", shape))
    run.note = f"peak store kept {kept} of 300 lines"
    if kept != 300:
        run.misses.append(f"the peak store lost {300 - kept} of 300 lines")
    h.to_the_end(run)


PEAK_WRITER = """
import sys
from pathlib import Path
from qlora_supervise.policies.memory_model import ModelShape
from qlora_supervise.supervisor.record.peak_store import record_attempt
from qlora_supervise.trainer_child.contract.spec import Knobs
shape = ModelShape(hidden=64, layers=2, heads=4, kv_heads=4, intermediate=128, vocab=256)
for i in range(150):
    knobs = Knobs(model="m", micro_batch_size=1 + i)
    record_attempt(Path(sys.argv[1]) / "peaks.jsonl", shape, knobs, 1000 + i, None)
"""


def extend_finished(h: Harness, run: Run) -> None:
    """Item 13: a finished run, then ``max_steps`` raised and the same command: it trains on from
    its last checkpoint to the new end (and a child kill during the extension changes nothing)."""
    code = h.wait_exit()
    run.exits.append(code)
    if code != 0:
        h.to_the_end(run, first_exit=code)
        return
    h.edit_job(max_steps=STEPS + 4)
    h.start()
    run.kills += 1
    if h.rng.random() < 0.5 and h.after_random_progress() and h.kill(h.child_pid()):
        run.kills += 1
    h.to_the_end(run)
    records, _ = read_attempts(h.run_dir / "attempts.jsonl")
    extension = [r for r in records if r.resumed_from > 0 and r.outcome.value == "succeeded"]
    if not extension:
        run.misses.append("the extension did not resume from a checkpoint")
    run.note = f"max_steps {STEPS} -> {STEPS + 4} after the run finished"


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
        metrics_unwritable,
        metrics_uncreatable,
        planted_link,
        host_oom_kill,
        peak_store_race,
        extend_finished,
        spare_sigstop,
    )
} | {**edges.SCENARIOS, **tools.SCENARIOS}  # issue 29's, at the edges and of the tools
REAL_SCENARIOS = ("child_kill", "supervisor_kill", "sigterm", "spare_sigstop")
#: Only with the real trainer: the scripted child never runs in a spare, nor has a learning rate.
REAL_ONLY = frozenset({"spare_sigstop"}) | tools.REAL_ONLY
#: The steps a finished run of each scenario trains (the job's max_steps at its end).
EXTRA_STEPS = {"job_change": 4, "extend_finished": 4, "merge_beside_run": edges.EXTRA_STEPS}


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
        _set_up(name, h)
        if name not in edges.SELF_STARTED:
            h.start()
        SCENARIOS[name](h, run)
        run.wall_s = time.monotonic() - started
        steps = REAL_STEPS + tools.EXTRA_REAL_STEPS.get(name, 0) if real else STEPS + EXTRA_STEPS.get(name, 0)
        measure(run, h.run_dir, h.stderr, h.damaged, steps, SAVE_STEPS)
        outside = h.written_outside()
        run.outside = len(outside)
        if outside:
            run.misses.append("written outside the run: " + ", ".join(outside[:5]))
        if keep is not None and not met_targets(run):  # the run directory of each miss, to read
            shutil.copytree(h.run_dir, keep / f"{name}-{seed}", ignore=KEEP_OUT)
    finally:
        h.close()
        shutil.rmtree(work, ignore_errors=True)
    return run


def _set_up(name: str, h: Harness) -> None:
    """What a scenario needs before the supervisor starts (issue 21's faults)."""
    if name == "metrics_unwritable":
        (h.work / "metrics").mkdir()
        h.allowed_outside.append(h.work / "metrics")
        h.edit_supervise(metrics_textfile=str(h.work / "metrics" / "run.prom"))
    elif name == "metrics_uncreatable":
        (h.work / "not-a-folder").write_text("a file where the textfile's folder should be\n")
        h.edit_supervise(metrics_textfile=str(h.work / "not-a-folder" / "run.prom"))
    elif name == "planted_link":
        outside = h.work / "outside"
        (outside / "ckpt").mkdir(parents=True)
        h.run_dir.mkdir()
        # A run of ours that stopped after its first event: a folder holding only the planted
        # link is no run of ours and is refused for that (issue 29 item 1), not for the link.
        (h.run_dir / "events.jsonl").write_text('{"event": "run_started", "level": "info"}\n')
        if h.rng.random() < 0.5:
            (h.run_dir / "checkpoints").symlink_to(outside)
        else:
            (h.run_dir / "checkpoints").mkdir()
            (h.run_dir / "checkpoints" / f"checkpoint-{SAVE_STEPS}").symlink_to(outside / "ckpt")
    elif name == "host_oom_kill":
        events = h.work / "memory.events"
        events.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
        h.env["QLORA_SUPERVISE_CGROUP_MEMORY_EVENTS"] = str(events)
    elif name == "peak_store_race":
        h.allowed_outside.append(h.work / "state")
        h.env["QLORA_SUPERVISE_STATE_DIR"] = str(h.work / "state")
    elif name == "spare_sigstop":
        h.edit_supervise(warm_spare=True)
    edges.set_up(name, h)
    tools.set_up(name, h)
    h.rebase_outside()


def met_targets(run: Run) -> bool:
    return (
        run.finished
        and not run.corrupt
        and not run.tracebacks
        and not run.lost_avoidable
        and not run.outside
        and not run.misses
    )


def table(runs: list[Run]) -> str:
    """The per-scenario table and the totals against the targets (Markdown)."""
    lines = [
        "| scenario | runs | faults | finished | lost inherent | lost avoidable | corrupt | tracebacks "
        "| outside run | other misses |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    groups: dict[str, list[Run]] = {}
    for r in runs:
        groups.setdefault(r.scenario + (" (real trainer)" if r.real else ""), []).append(r)
    for name, rs in [*groups.items(), ("**all**", runs)]:
        lines.append(
            f"| {name} | {len(rs)} | {sum(r.kills for r in rs)} | {sum(r.finished for r in rs)}/{len(rs)} | "
            f"{sum(r.lost_inherent for r in rs)} | {sum(r.lost_avoidable for r in rs)} | "
            f"{sum(len(r.corrupt) for r in rs)} | {sum(r.tracebacks for r in rs)} | "
            f"{sum(r.outside for r in rs)} | {sum(len(r.misses) for r in rs)} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=36, help="scripted-child runs (scenarios in turn)")
    parser.add_argument(
        "--real", type=int, default=0, help="extra runs of the real trainer on the tiny model"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", nargs="+", choices=sorted(SCENARIOS), help="run these scenarios only")
    parser.add_argument(
        "--out", type=Path, help="write results.json, table.md and the misses' run directories here"
    )
    args = parser.parse_args()
    names = args.only or [name for name in SCENARIOS if name not in REAL_ONLY]
    real_names = args.only or list(REAL_SCENARIOS)
    plan = [(names[i % len(names)], args.seed * 1000 + i, False) for i in range(args.runs if names else 0)]
    plan += [(real_names[i % len(real_names)], args.seed * 1000 + 500 + i, True) for i in range(args.real)]
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
            f"{'corrupt ' + ','.join(run.corrupt) if run.corrupt else ''} {run.note} "
            f"{'; '.join(run.misses)} ({run.wall_s:.1f}s)",
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
