"""Issue 29's faults at the edges: whose folder the run is in, links at every run entry, merge beside
a run, input past its bounds, a loud hook, a tool value that did not parse, and the refusals in words.

Each scenario leaves the run to finish as the others do (measured the same way: finished, lost
steps, corrupt states, tracebacks, writes outside the run) and adds its own checks as *misses*:

* ``foreign_output_dir`` (item 1) - ``output_dir`` is a user's folder (their ``adapter/``,
  ``state.json``, ``checkpoints/checkpoint-5``, ``job.yaml``): ``run`` and ``run --restart`` exit 2
  in words and the files keep their bytes; then a system folder (``/``, ``/etc``, ``/usr``, ``/var``,
  the home, a folder under ``/proc`` or ``/sys``): ``validate`` and ``run`` exit 2; then the job
  names a folder of its own and runs;
* ``planted_entry_link`` (item 2) - the run stopped (SIGTERM) mid-run, a link planted at a random
  registered entry of the run directory (``record/rundir.ENTRIES``) to a target outside: the same
  command exits 2 and the target keeps its bytes; with the link removed the run finishes;
* ``merge_beside_run`` (item 3) - ``qlora-supervise merge`` while the supervisor extends a finished
  run (the adapter exists, and is about to be replaced): exit 2, nothing written (no
  ``merge-command/``, no ``merged/``); the extension finishes;
* ``bounded_input`` (item 4) - the job file 600 levels deep, then 12.8 MB, then 20000 values: each
  ``run`` exits 2 naming the bound, within 20 s and 150 MB (measured); the job restored, the run
  finishes;
* ``loud_hook`` (item 6) - an ``on_event`` hook that prints 300 MB on each stream and fails: the
  supervisor's peak RSS (``VmHWM``) stays under 250 MB and ``hook_failed`` keeps its last line;
* ``unparsed_tool_value`` (item 9) - a trl job with ``max_steps: ten`` that the tool refuses (the
  scripted child's config error), then fixed to 2: no ``-1 -> 2`` and no "would mix two trainings";
* ``refused_words`` (item 11) - after a finished run: ``explain --plot`` into a missing folder and
  ``merge --device cuda`` without a GPU exit 2 in words, nothing written.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from qlora_supervise.supervisor.record.rundir import ENTRIES

from .harness import STEPS, Harness, Run

EXTRA_STEPS = 30  # merge_beside_run extends the finished run by this many steps (2-3 s)
CLI = [sys.executable, "-m", "qlora_supervise.supervisor.commands.cli"]
#: The CLI in a process of its own that prints its peak RSS (to bound the memory of a refusal).
MEASURED = (
    "import sys\n"
    "from qlora_supervise.supervisor.commands.cli import main\n"
    "try:\n"
    "    code = main(sys.argv[1:])\n"
    "except SystemExit as stop:\n"
    "    code = stop.code\n"
    # VmHWM: this process's own peak since its exec (ru_maxrss also counts the parent's at the fork)
    "hwm = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]\n"
    "print(f'maxrss_kb={hwm}', file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def cli(h: Harness, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The real CLI; its stderr joins the run's (tracebacks there are counted)."""
    done = subprocess.run(
        [*CLI, *args], capture_output=True, text=True, timeout=300, env=env or h.env, check=False
    )
    h.stderr.append(done.stderr)
    return done


def _tree(root: Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


def _set_output_dir(h: Harness, where: str) -> None:
    raw = yaml.safe_load(h.job.read_text())
    raw["output_dir"] = where
    h.job.write_text(yaml.safe_dump(raw))


def foreign_output_dir(h: Harness, run: Run) -> None:
    """A user's folder (run and run --restart), then a system folder (validate and run): all exit 2."""
    mine = h.work / "mine"
    (mine / "adapter").mkdir(parents=True)
    (mine / "adapter" / "adapter_model.safetensors").write_bytes(b"user weights" * 1000)
    (mine / "checkpoints" / "checkpoint-5").mkdir(parents=True)
    (mine / "checkpoints" / "checkpoint-5" / "trainer_state.json").write_text('{"global_step": 5}\n')
    (mine / "state.json").write_text('{"mine": true}\n')
    (mine / "job.yaml").write_text("my: notes\n")
    h.rebase_outside()
    before = _tree(mine)
    _set_output_dir(h, str(mine))
    for extra in ([], ["--restart"]):
        done = cli(h, "run", *extra, str(h.job))
        if done.returncode != 2 or "holds no run of qlora-supervise" not in done.stderr:
            run.misses.append(f"run {' '.join(extra)} in a user's folder: exit {done.returncode}")
    if _tree(mine) != before:
        run.misses.append("the user's folder changed")
    where = h.rng.choice(["/", "/etc", "/usr", "/var", "/proc/qlora-run", "/sys/qlora-run", str(Path.home())])
    _set_output_dir(h, where)
    for command in ("validate", "run"):
        done = cli(h, command, str(h.job))
        if done.returncode != 2 or "output_dir: is " not in done.stdout + done.stderr:
            run.misses.append(f"{command} with output_dir {where}: exit {done.returncode}")
    run.note = f"a user's folder (run, run --restart) and {where} (validate, run) refused"
    run.kills += 2
    _set_output_dir(h, str(h.run_dir))
    h.start()
    h.to_the_end(run)


def planted_entry_link(h: Harness, run: Run) -> None:
    if not h.after_random_progress():
        run.misses.append("the run never trained")
        h.to_the_end(run)
        return
    assert h.proc is not None
    h.proc.send_signal(signal.SIGTERM)
    run.exits.append(h.wait_exit())
    named = [e for e in ENTRIES if not e.pattern]
    entry = h.rng.choice(named)
    target = h.work / "outside-target"
    if entry.is_dir:
        target.mkdir()
    else:
        target.write_text("precious\n")
    link = h.run_dir / entry.name
    aside = h.work / "entry-aside"
    if link.exists() or link.is_symlink():
        os.rename(link, aside)
    link.symlink_to(target)
    h.rebase_outside()
    before = _tree(target) if entry.is_dir else target.read_text()
    h.start()
    code = h.wait_exit()
    run.exits.append(code)
    run.kills += 1
    after = _tree(target) if entry.is_dir else target.read_text()
    if code != 2 or "symbolic link" not in h.stderr[-1]:
        run.misses.append(f"a link at {entry.name}: exit {code}")
    if after != before:
        run.misses.append(f"written through a link at {entry.name}")
    link.unlink()
    if aside.exists():
        os.rename(aside, link)
    run.note = f"link at {entry.name} refused"
    h.start()
    h.to_the_end(run)


def merge_beside_run(h: Harness, run: Run) -> None:
    code = h.wait_exit()  # a finished run (its adapter exists), then extended: merge during the extension
    run.exits.append(code)
    h.edit_job(max_steps=STEPS + EXTRA_STEPS)
    h.start()
    if code == 0 and h.after_random_progress():
        done = cli(h, "merge", str(h.run_dir), "--device", "cpu")
        run.kills += 1
        if done.returncode != 2 or "a supervisor is running" not in done.stderr:
            run.misses.append(f"merge beside a running supervisor: exit {done.returncode}")
        if (h.run_dir / "merge-command").exists() or (h.run_dir / "merged").exists():
            run.misses.append("merge wrote into a run a supervisor holds")
        run.note = "merge refused while the run's extension trained"
    h.to_the_end(run)


def bounded_input(h: Harness, run: Run) -> None:
    """The job file 600 levels deep, 12.8 MB, then 20000 values: each ``run`` is exit 2, bounded."""
    original = h.job.read_text()
    notes = []
    for kind in ("deep", "large", "many"):
        _oversize(h.job, original, kind)
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", MEASURED, "run", str(h.job)], capture_output=True, text=True, env=h.env
        )
        took = time.monotonic() - started
        h.stderr.append(done.stderr)
        rss_mb = int(done.stderr.rsplit("maxrss_kb=", 1)[1]) / 1000 if "maxrss_kb=" in done.stderr else -1
        words = {"deep": "nested too deep", "large": "the file is too large", "many": "too many values"}[kind]
        if done.returncode != 2 or words not in done.stderr or "alias" in done.stderr:
            run.misses.append(f"{kind} job file: exit {done.returncode}")
        if took > 20 or not 0 < rss_mb < 150:
            run.misses.append(f"{kind} job file refused in {took:.1f} s, {rss_mb:.0f} MB")
        notes.append(f"{kind} ({h.job.stat().st_size} bytes) {took:.1f} s {rss_mb:.0f} MB")
        run.kills += 1
    run.note = "refused: " + ", ".join(notes)
    h.job.write_text(original)
    h.start()
    h.to_the_end(run)


def _oversize(job: Path, original: str, kind: str) -> None:
    if kind == "deep":
        job.write_text(original + "notes: " + "[" * 600 + "]" * 600 + "\n")
    elif kind == "many":
        job.write_text(original + "notes: [" + ", ".join(str(i) for i in range(20_000)) + "]\n")
    else:
        with job.open("w") as handle:
            handle.write(original)
            for i in range(165_000):
                handle.write(
                    f"k{i:06d}: [{i}, {i + 1}, padding padding padding padding padding padding pad]\n"
                )


LOUD_HOOK = (
    "import sys\n"
    "block = b'x' * (1 << 20)\n"
    "for _ in range(300):\n"
    "    sys.stdout.buffer.write(block)\n"
    "    sys.stderr.buffer.write(block)\n"
    "sys.stderr.buffer.write(b'\\nthe pager answered 503\\n')\n"
    "sys.exit(3)\n"
)


def loud_hook(h: Harness, run: Run) -> None:
    assert h.proc is not None
    pid, peak_kb = h.proc.pid, 0
    while h.proc.poll() is None:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            peak_kb = max(peak_kb, int(status.split("VmHWM:")[1].split()[0]))
        except (OSError, IndexError, ValueError):
            pass
        time.sleep(0.05)
    h.to_the_end(run)
    run.kills += 1
    events = (h.run_dir / "events.jsonl").read_text()
    if "the pager answered 503" not in events:
        run.misses.append("hook_failed does not keep the hook's last line")
    if not 0 < peak_kb < 250_000:
        run.misses.append(f"the supervisor peaked at {peak_kb / 1000:.0f} MB beside a loud hook")
    run.note = f"hook printed 600 MB; supervisor peak RSS {peak_kb / 1000:.0f} MB"


def unparsed_tool_value(h: Harness, run: Run) -> None:
    tool = h.work / "tool"
    (tool / "model").mkdir(parents=True)
    (tool / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    sft = (
        "model_name_or_path: model\ndataset_name: /data/set\nuse_peft: true\nmax_steps: ten\nsave_steps: 10\n"
    )
    (tool / "sft.yaml").write_text(sft)
    (tool / "job.yaml").write_text(
        "trainer: {kind: trl-sft, config: sft.yaml}\nresources: {gpu: cpu}\n"
        "supervise: {hang_timeout: 5s, backoff_initial: 0.05s, backoff_max: 0.2s}\noutput_dir: run\n"
    )
    (tool / "plan.json").write_text(json.dumps({"default": "config_error"}))  # the tool refuses it
    h.allowed_outside.append(tool)
    env = {**h.env, "SCRIPTED_CHILD_PLAN": str(tool / "plan.json")}
    scripted = [sys.executable, str(h.command()[1]), str(tool / "job.yaml")]
    first = subprocess.run(scripted, capture_output=True, text=True, env=env, timeout=300)
    (tool / "sft.yaml").write_text(sft.replace("max_steps: ten", "max_steps: 2"))
    again = subprocess.run(scripted, capture_output=True, text=True, env=env, timeout=300)
    h.stderr += [first.stderr, again.stderr]
    said = again.stdout + again.stderr
    if first.returncode != 4 or "'ten' -> 2" not in said or "-1 -> 2" in said or "would mix" in said:
        run.misses.append(f"max_steps ten -> 2: exits {first.returncode}, {again.returncode}")
    run.kills += 1
    run.note = "max_steps: ten recorded as written; fixed without --restart"
    h.to_the_end(run)


def refused_words(h: Harness, run: Run) -> None:
    h.to_the_end(run)
    plot = cli(h, "explain", str(h.run_dir), "--plot", str(h.work / "no" / "such" / "x.png"))
    if plot.returncode != 2 or "does not exist" not in plot.stderr:
        run.misses.append(f"explain --plot into a missing folder: exit {plot.returncode}")
    cuda = cli(h, "merge", str(h.run_dir), "--device", "cuda", env={**h.env, "CUDA_VISIBLE_DEVICES": ""})
    if cuda.returncode != 2 or "no GPU is visible" not in cuda.stderr:
        run.misses.append(f"merge --device cuda without a GPU: exit {cuda.returncode}")
    if (h.run_dir / "merge-command").exists():
        run.misses.append("merge --device cuda wrote merge-command/")
    run.kills += 2
    run.note = "explain --plot and merge --device cuda refused in words"


SCENARIOS = {
    f.__name__: f
    for f in (
        foreign_output_dir,
        planted_entry_link,
        merge_beside_run,
        bounded_input,
        loud_hook,
        unparsed_tool_value,
        refused_words,
    )
}


def set_up(name: str, h: Harness) -> None:
    """What an edge scenario needs before the supervisor starts."""
    if name == "loud_hook":
        (h.work / "hook.py").write_text(LOUD_HOOK)
        h.edit_supervise(on_event=[sys.executable, str(h.work / "hook.py")], on_event_timeout="120s")


#: Scenarios that start the supervisor themselves (on a refused output_dir or job file first).
SELF_STARTED = frozenset({"foreign_output_dir", "bounded_input"})
