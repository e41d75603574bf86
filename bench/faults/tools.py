"""Issue 29's faults of the tools: a tool's refusal, host kills after progress, Ctrl-C under tee,
an extended run's schedule.

Each scenario leaves the run to finish as the others do (measured the same way: finished, lost
steps, corrupt states, tracebacks, writes outside the run) and adds its own checks as *misses*:

* ``tool_refusal`` (items 5, 10) - beside the run, a real tool process (an hf-script job whose
  tool sits in a ``site-packages`` folder) refuses before its first step, one of: its argument
  parser (``--max_steps ten``, exit 2), a ``ValueError`` for an unknown ``--optim``, transformers'
  CPU refusal (``You need to assign use_cpu``), or safetensors itself on a model file cut short.
  ``run`` must stop after one attempt with exit 4, ``config_error``, the tool's line as the message
  (and, for the CPU, the fix ``use_cpu: true`` / ``bf16: false``); the job fixed, the same command
  lifts the verdict (a key the supervisor reads itself, such as ``optim``, asks for ``--restart``
  as a job field would, and ``run --restart`` follows) and the tool finishes (exit 0);
* ``host_kills_apart`` (item 7) - two host OOM kills (``oom_kill`` counted, then SIGKILL) of the
  scripted child with the same knobs: half the runs 5-6 good steps apart, which must both be
  retried unchanged (the LoRA rank and every knob kept); half at the same step, which walks the
  ladder to a throughput rung (which one: the stage the heartbeats last showed), the rank kept;
* ``ctrl_c_tee`` (item 10) - the installed command's ``main`` under ``| tee`` with stderr in the
  pipe, and SIGINT to both ``tee`` and the supervisor after random progress (a terminal's Ctrl-C):
  exit 130 (not 141), the stop journaled; the same command finishes the run;
* ``extend_schedule`` (item 8, real trainer only) - the finished tiny run (cosine) extended by 4
  steps: the resumed step's learning rate is the schedule over the new total's at that step
  (never 0, the old schedule's end), and each new step's logged rate follows it.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from qlora_supervise.policies.rungs import RUNG_CLASSES, CostClass
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts

from .harness import REAL_STEPS, SCRIPTED, Harness, Run

CLI = [sys.executable, "-m", "qlora_supervise.supervisor.commands.cli"]
EXTEND_BY = 4  # extend_schedule trains this many steps more than the finished run

# -- tool_refusal ---------------------------------------------------------------------------

#: A tool that refuses as real ones do, before any step; with good arguments it writes its output.
_TOOL = """import argparse, os, sys
parser = argparse.ArgumentParser(prog="tool.py")
parser.add_argument("--output_dir")
parser.add_argument("--max_steps", type=int, default=2)
parser.add_argument("--optim", default="adamw_torch")
parser.add_argument("--bf16", default="false")
parser.add_argument("--model", default=None)
args = parser.parse_args()
if args.optim not in ("adamw_torch", "paged_adamw_8bit"):
    raise ValueError(f"{args.optim} is not a valid OptimizerNames, please select one of ['adamw_torch']")
if args.bf16 == "true":
    raise ValueError("Your setup doesn't support bf16/gpu. You need to assign use_cpu if you want to "
                     "train the model on CPU.")
if args.model:
    from safetensors import safe_open
    with safe_open(os.path.join(args.model, "model.safetensors"), "np") as weights:
        list(weights.keys())
os.makedirs(args.output_dir, exist_ok=True)
open(os.path.join(args.output_dir, "done"), "w").write("trained\\n")
"""
#: (the bad arguments, the good ones, the tool's words in its line, a fix the evidence must name)
_REFUSALS = {
    "parser": (["--max_steps", "ten"], ["--max_steps", "2"], "tool.py: error: argument --max_steps", None),
    "optim": (["--optim", "adamw_nonsense"], ["--optim", "adamw_torch"], "ValueError: adamw_nonsense", None),
    "cpu": (["--bf16", "true"], ["--bf16", "false"], "ValueError: Your setup doesn't support bf16/gpu",
            "use_cpu: true and bf16: false"),
    "model_file": (["--model", "MODEL"], [], "SafetensorError: Error while deserializing header",
                   "download the model again"),
}  # fmt: skip


def tool_refusal(h: Harness, run: Run) -> None:
    """Items 5 and 10 beside the run (module docstring); the run itself goes to its end."""
    which = h.rng.choice(sorted(_REFUSALS))
    bad, good, line, fix = _REFUSALS[which]
    tool = h.work / "tool"
    job = _tool_job(tool, bad)
    env = {**h.env, "PYTHONPATH": str(tool / "site-packages")}
    first = _cli(h, env, "run", "--plain", str(job))
    run.kills += 1  # the fault: a refusal, once
    records, _ = read_attempts(tool / "run" / "attempts.jsonl")
    failure = records[0].failure if len(records) == 1 else None
    if first.returncode != 4 or failure is None or failure.kind.value != "config_error":
        what = f"exit {first.returncode}, {len(records)} attempt(s)"
        run.misses.append(f"{which}: {what}, not one config_error")
    elif line not in failure.message or (fix is not None and fix not in failure.evidence):
        run.misses.append(f"{which}: the tool's line or its fix is missing: {failure.message[:80]!r}")
    _tool_job(tool, good)  # the user fixes the job's command (a change of the job)
    second = _cli(h, env, "run", "--plain", str(job))
    how = "lifted"
    if second.returncode == 2 and "run --restart" in second.stderr:
        # A key the supervisor reads (max_steps, optim) changes what is trained, as in a job file:
        # the message asks for --restart, and the user runs it.
        second, how = _cli(h, env, "run", "--restart", "--plain", str(job)), "--restart"
    lifted = any(
        e["event"] in ("verdict_lifted", "generation_started")
        for e in read_events(tool / "run" / "events.jsonl")
    )
    if second.returncode != 0 or not lifted or not (tool / "run" / "trainer-output" / "done").is_file():
        run.misses.append(f"{which}: after the fix exit {second.returncode}, verdict lifted {lifted}")
    run.note = f"refusal {which}, fixed ({how})"
    h.to_the_end(run)


def _tool_job(tool: Path, arguments: list[str]) -> Path:
    """``tool/job.yaml``: an hf-script job running the tool with ``arguments`` (``MODEL``: a model
    folder whose ``model.safetensors`` is cut short)."""
    site = tool / "site-packages"
    if not site.is_dir():
        site.mkdir(parents=True)
        (site / "tool.py").write_text(_TOOL)
        model = tool / "model"
        model.mkdir()
        header = json.dumps({"w": {"dtype": "F32", "shape": [64], "data_offsets": [0, 256]}}).encode()
        (model / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    arguments = [str(tool / "model") if a == "MODEL" else a for a in arguments]
    command = [sys.executable, "-m", "tool", "--output_dir", "out", *arguments]
    job = {
        "trainer": {"kind": "hf-script", "command": command},
        "resources": {"gpu": "cpu"},
        "supervise": {"backoff_initial": "0.05s", "backoff_max": "0.2s"},
        "output_dir": str(tool / "run"),
    }
    (tool / "job.yaml").write_text(yaml.safe_dump(job))
    return tool / "job.yaml"


def _cli(h: Harness, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The real CLI; its stderr joins the run's (tracebacks there are counted)."""
    done = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, env=env, check=False)
    h.stderr.append(done.stderr)
    return done


# -- host_kills_apart -------------------------------------------------------------------------


def host_kills_apart(h: Harness, run: Run) -> None:
    """Item 7 (module docstring): the plan was set before the start (:func:`set_up`)."""
    h.to_the_end(run)
    records, _ = read_attempts(h.run_dir / "attempts.jsonl")
    killed = [r for r in records if r.failure is not None and r.failure.kind.value == "host_oom"]
    run.kills += len(killed)
    rungs = [r.decision.rung if r.decision else None for r in killed]
    plan = json.loads(Path(h.env["SCRIPTED_CHILD_PLAN"]).read_text())
    apart = plan["1"] != plan["2"]
    run.note = f"kills {plan['1']} and {plan['2']}"
    if len(killed) != 2:
        run.misses.append(f"{len(killed)} host OOM kill(s) journalled, not 2")
    elif apart and rungs != ["retry_unchanged", "retry_unchanged"]:
        run.misses.append(f"kills after good steps between them moved the ladder: {rungs}")
    elif not apart and (rungs[0] != "retry_unchanged" or _quality(rungs[1])):
        run.misses.append(f"a kill at the same step again took {rungs}, not a throughput rung")
    if len({r.knobs.lora_r for r in records}) != 1:
        run.misses.append("the LoRA rank changed after host OOM kills")


def _quality(rung: str | None) -> bool:
    """Whether the decision ``rung`` (``+``-joined) cuts quality, or is no rung at all."""
    names = (rung or "").split("+")
    return not rung or any(RUNG_CLASSES.get(name) is CostClass.QUALITY for name in names)


# -- ctrl_c_tee -----------------------------------------------------------------------------


def ctrl_c_tee(h: Harness, run: Run) -> None:
    """Item 10 (module docstring): the pipeline was made the harness's command in :func:`set_up`."""
    assert h.proc is not None
    stopped = h.after_random_progress()
    if stopped:
        # A terminal's Ctrl-C: SIGINT to the foreground job, the supervisor and tee alike.
        for pid in _children(h.proc.pid):
            os.kill(pid, signal.SIGINT)
        run.kills += 1
    h.to_the_end(run)  # a stop (130) is followed by the same command, as a person would
    if stopped:
        records, _ = read_attempts(h.run_dir / "attempts.jsonl")
        if run.exits[0] != 130:
            run.misses.append(f"Ctrl-C under tee exited {run.exits[0]}, not 130")
        if not any(r.outcome.value == "stopped" for r in records):
            run.misses.append("the stop was not journalled")
    log = h.work / "tee.log"
    h.stderr.append(log.read_text(errors="replace") if log.exists() else "")  # tracebacks are counted


def _children(pid: int) -> list[int]:
    done = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False)
    return [int(p) for p in done.stdout.split()]


# -- extend_schedule (real trainer) -----------------------------------------------------------


def extend_schedule(h: Harness, run: Run) -> None:
    """Item 8 (module docstring): cosine with warmup over the new total, stepped to the resume."""
    code = h.wait_exit()
    run.exits.append(code)
    if code != 0:
        h.to_the_end(run, first_exit=code)
        return
    raw = yaml.safe_load(h.job.read_text())
    total, base = REAL_STEPS + EXTEND_BY, float(raw["train"]["learning_rate"])
    h.edit_job(max_steps=total)
    h.start()
    run.kills += 1  # the fault: the finished run's length raised
    h.to_the_end(run)
    attempts = sorted(h.run_dir.glob("attempt-*/child-events.jsonl"))
    lines = attempts[-1].read_text().splitlines() if attempts else []
    resumed = [e for e in map(json.loads, lines) if e.get("event") == "resumed"]
    if not resumed:
        run.misses.append("the extension did not resume")
        return
    step, rate = int(resumed[0]["from_step"]), float(resumed[0]["learning_rate"] or 0.0)
    warmup = math.ceil(float(raw["train"]["warmup_ratio"]) * total)
    expected = base * _cosine_with_warmup(step, total, warmup)
    if not math.isclose(rate, expected, rel_tol=1e-6) or rate <= 0:
        run.misses.append(f"resumed at step {step} with learning rate {rate}, not {expected:.3g}")
    run.note = f"max_steps {REAL_STEPS} -> {total}: step {step + 1} at lr {rate:.3g}, expected {expected:.3g}"


def _cosine_with_warmup(step: int, total: int, warmup: int) -> float:
    """transformers' ``cosine`` schedule's factor at ``step`` (one half-cycle after a linear warmup)."""
    if step < warmup:
        return step / max(1, warmup)
    progress = (step - warmup) / max(1, total - warmup)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


# -- the suite's hooks --------------------------------------------------------------------------

SCENARIOS = {
    "tool_refusal": tool_refusal,
    "host_kills_apart": host_kills_apart,
    "ctrl_c_tee": ctrl_c_tee,
    "extend_schedule": extend_schedule,
}
#: Only with the real trainer: the scripted child has no learning rate.
REAL_ONLY = frozenset({"extend_schedule"})
#: The steps a finished extend_schedule run trains (the job's max_steps at its end), real trainer.
EXTRA_REAL_STEPS = {"extend_schedule": EXTEND_BY}


def set_up(name: str, h: Harness) -> None:
    """What a scenario needs before the supervisor starts."""
    if name == "tool_refusal":
        h.allowed_outside.append(h.work / "tool")
    elif name == "host_kills_apart":
        events = h.work / "memory.events"
        events.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
        h.env["QLORA_SUPERVISE_CGROUP_MEMORY_EVENTS"] = str(events)
        h.env["SCRIPTED_CHILD_OOM_EVENTS"] = str(events)
        first = h.rng.randint(3, 5)
        apart = h.rng.random() < 0.5
        second = first + h.rng.randint(5, 6) if apart else first
        Path(h.env["SCRIPTED_CHILD_PLAN"]).write_text(
            json.dumps({"1": f"sigkill@{first}", "2": f"sigkill@{second}", "default": "ok"})
        )
    elif name == "ctrl_c_tee":
        log = h.work / "tee.log"
        command = f"{sys.executable} {SCRIPTED} --cli run {h.job} --plain"
        pipeline = f"{command} 2>&1 | tee -a {log}; exit ${{PIPESTATUS[0]}}"
        h.command = lambda: ["bash", "-c", pipeline]  # this run's command: under tee
        h.allowed_outside.append(log)
