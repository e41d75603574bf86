"""``qlora-supervise status [RUN_DIR ...] [--json] [--follow]``: the retry story of run directories,
read from the run directory alone (a supervisor running or not), and the summary ``run`` ends with.
``--json`` prints one object, schema ``qlora-supervise.status/1`` (docs/run-directory.md, "The JSON
of status and explain"). ``--follow`` prints again on every change of a run's journal, state or
running attempt's heartbeats, until every run has ended (succeeded, gave up, failed, stopped)."""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import psutil

from qlora_supervise.policies.rungs import knob_changes
from qlora_supervise.supervisor.commands import BadInput
from qlora_supervise.supervisor.commands.merge import adapter_step, merge_report, merged_record
from qlora_supervise.supervisor.diagnosis import advice
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.record import history, journal
from qlora_supervise.supervisor.record.journal import AttemptRecord, RunState, read_attempts, read_state
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.trainers.trainer import read_diff, saved_by_the_tool_only
from qlora_supervise.trainer_child.contract.events import Heartbeat, read_events
from qlora_supervise.trainer_child.contract.spec import MEMORY_SNAPSHOT_NAME

#: How to read the allocator snapshot an OOM left (``diagnose.memory_history: true``).
SNAPSHOT_HOW_TO = (
    "open https://pytorch.org/memory_viz and drop the file on the page (it runs in the browser; "
    "'Active Memory Timeline' shows what filled the card, 'Allocator State History' the segments)"
)

SCHEMA = "qlora-supervise.status/1"
_ENDED = {RunState.SUCCEEDED, RunState.GAVE_UP, RunState.FAILED, RunState.STOPPED}


def status_command(
    output_dirs: Sequence[str],
    as_json: bool = False,
    follow: bool = False,
    out: TextIO | None = None,
    every_s: float = 2.0,
) -> int:
    out = out or sys.stdout  # at call time: a redirected stdout (tests, pipes) is the one to use
    paths = output_dirs or ["."]
    dirs = [RunDir(Path(path)) for path in paths]
    for path, rd in zip(paths, dirs, strict=True):
        if not rd.attempts.exists() and not rd.state.exists():
            why = "no state.json or attempts.jsonl"
            raise BadInput(f"{path} is not a run directory ({why}); pass the job's output_dir")
    seen: list[tuple[float, ...]] = []
    while True:
        if (marks := [_marks(rd) for rd in dirs]) != seen:
            if as_json:
                runs = [status_json(rd) for rd in dirs]
                print(json.dumps({"schema": SCHEMA, "runs": runs}, indent=2), file=out)
            else:
                for index, rd in enumerate(dirs):
                    if index:
                        print(file=out)
                    print_story(rd, out)
                out.flush()
        seen = marks
        if not follow or all((state := read_state(rd.state)) and state.run_state in _ENDED for rd in dirs):
            return 0
        time.sleep(every_s)


def _marks(rd: RunDir) -> tuple[float, ...]:
    # The attempt in flight's heartbeats too: --follow shows its step and speed as they move.
    flight = state.in_flight if (state := read_state(rd.state)) is not None else None
    beats = (rd.attempt(flight.number).events,) if flight is not None else ()
    return tuple(p.stat().st_mtime_ns if p.exists() else 0 for p in (rd.state, rd.attempts, *beats))


def status_json(rd: RunDir) -> dict[str, Any]:
    """One run's status as plain JSON (the schema in docs/run-directory.md)."""
    state = read_state(rd.state)
    records, bad = read_attempts(rd.attempts)
    attempts = [
        {
            **json.loads(r.to_line()),
            "child_log": str(rd.attempt(r.attempt).log),
            "fix": fix_line(r),
            "tokens_per_s": history.measured_speed(rd, r).tokens_per_s,
            "trainer_config_diff": read_diff(rd.attempt_dir(r.attempt)),  # None: our own trainer
        }
        for r in records
    ]
    running = running_attempt(rd, state, records[-1].attempt if records else 0)
    return {
        "run_dir": str(rd.root),
        "state": state.run_state.value if state else None,
        "note": state.note if state else "",
        "lost_steps": sum(r.lost_steps for r in records),
        "adapter": str(rd.adapter) if rd.adapter.exists() else None,
        "merged": str(rd.merged) if rd.merged.exists() else None,
        "merge": merge_report(rd),  # with "adapter_step" when `qlora-supervise merge` made it
        "merged_by_command": merged_record(rd),
        "trainer_output": _tool_saved(rd, state),
        "unreadable_lines": bad,
        "attempts": attempts,
        "running": running.to_json() if running is not None else None,
        "planned_restarts": history.planned_restarts(records),  # {"step_up": n, "retime": n}
        "time_in_configs": [c.to_json() for c in history.time_in_configs(records)],
    }


def print_story(run_dir: RunDir, out: TextIO) -> None:
    state = read_state(run_dir.state)
    records, bad = read_attempts(run_dir.attempts)
    lines = [f"run directory: {run_dir.root}"]
    if state is not None:
        lines.append(f"state: {state.run_state.value}{f' ({state.note})' if state.note else ''}")
    for record in records:
        lines += describe(record, run_dir)
        if (snapshot := run_dir.attempt_dir(record.attempt) / MEMORY_SNAPSHOT_NAME).is_file():
            lines += [f"  memory snapshot: {snapshot}", f"    {SNAPSHOT_HOW_TO}"]
    running = running_attempt(run_dir, state, records[-1].attempt if records else 0)
    lines += running.lines() if running is not None else []
    if bad:
        lines.append(f"({bad} unreadable journal line(s) skipped)")
    now = f" (+1 running: attempt {running.flight.number})" if running is not None else ""
    lines.append(f"attempts: {len(records)}{now}, lost steps in total: {sum(r.lost_steps for r in records)}")
    configs = [c.to_json() for c in history.time_in_configs(records)]
    lines += history.climb_back_lines(history.planned_restarts(records), configs)
    if run_dir.adapter.exists():
        lines.append(f"adapter: {run_dir.adapter}")
    elif tool_output := _tool_saved(run_dir, state):
        lines.append(f"adapter: none in the run directory; the tool saved into {tool_output}")
    print("\n".join(lines + merge_lines(run_dir)), file=out)


def merge_lines(rd: RunDir) -> list[str]:
    """The merged model(s) and the adapter step each was made from, when it is known (a merge
    made from an older adapter than the run's says so, with the command that merges again)."""
    lines = []
    now, made = adapter_step(rd), merged_record(rd)
    if rd.merged.exists():
        report = merge_report(rd) or {}
        parts = [f"{report.get('device')}", f"{report.get('dtype')}", f"{report.get('seconds', 0):.0f} s"]
        for key, label in (("host_peak_bytes", "host peak"), ("gpu_peak_bytes", "GPU peak")):
            parts += [f"{label} {format_bytes(report[key])}"] if isinstance(report.get(key), int) else []
        numbers = f" ({', '.join(parts)})" if report else ""
        lines.append(f"merged: {rd.merged}{numbers}{_from_step(report.get('adapter_step'), now, rd)}")
    if made and (made_dir := str(made.get("merged_dir"))) != str(rd.merged) and Path(made_dir).exists():
        step = _from_step(made.get("adapter_step"), now, rd)
        lines.append(f"merged by `qlora-supervise merge --out`: {made_dir}{step}")
    return lines


def _from_step(step: object, now: int | None, rd: RunDir) -> str:
    if not isinstance(step, int):
        return ""
    older = f": older than the run's adapter (step {now}); run `qlora-supervise merge {rd.root}` again"
    return f", from the adapter of step {step}" + (older if now is not None and step != now else "")


def _tool_saved(rd: RunDir, state: journal.State | None) -> str | None:
    """Where a finished run's foreign tool saved its result when no adapter of ours was written."""
    finished = state is not None and state.run_state is RunState.SUCCEEDED
    return str(output) if finished and (output := saved_by_the_tool_only(rd.root, rd.adapter)) else None


def fix_line(r: AttemptRecord) -> str | None:
    """The line of a failure that names what to change: the child's message for errors no rung can
    fix (it names the field and the allowed values), else the decision's reason."""
    if r.failure is None:
        return None
    message = r.failure.message.strip().splitlines()
    last = message[-1][:600] if message else None  # stripped: a last line is never empty
    if r.failure.kind.value == "config_error" and last:
        return last
    return r.decision.why if r.decision is not None else last


def describe(r: AttemptRecord, run_dir: RunDir | None = None) -> list[str]:
    """A few lines per attempt: config, outcome, failure, the fix, decision, progress kept."""
    steps = f"steps {r.resumed_from} -> {r.steps_completed}"
    if r.steps_progressed == 0 and r.resumed_from > 0:
        steps = f"resumed at step {r.resumed_from}, trained no step"  # steps_completed 0 (issue 21 item 6)
    lines = [f"attempt {r.attempt} [{r.phase.value}] {r.outcome.value}: {steps}"]
    lines.append(f"  config: {history.config_text(r.knobs)}")
    if run_dir is not None and (diff := read_diff(run_dir.attempt_dir(r.attempt))) is not None:
        # A foreign trainer's attempt: its config against the user's file (supervisor/trainers/).
        lines.append(f"  trainer config (vs your file): {'; '.join(diff) or 'unchanged'}")
    if run_dir is not None and (speed := history.speed_line(history.measured_speed(run_dir, r))):
        lines.append(speed)
    if r.plan is not None:
        planned = "as written (--as-written)" if r.plan.as_written else "pre-flight"
        peak = format_bytes(r.plan.predicted_peak) if r.plan.predicted_peak else "-"
        budget = format_bytes(r.plan.budget) if r.plan.budget else "-"
        lines.append(f"  plan: {planned}, predicted peak {peak} of {budget}: {r.plan.why[-1]}")
    if r.peak:
        lines.append(f"  peak memory: {format_bytes(r.peak.bytes)} ({r.peak.source.value})")
    if (host := host_line(r)) is not None:
        lines.append(host)
    if r.failure:
        f = r.failure
        lines.append(f"  failed: {f.kind.value} in {f.stage.value} - {f.evidence}")
        if numbers := {k: v for k, v in f.numbers_json().items() if k not in advice.BATCH_KEYS}:
            big = {k: format_bytes(v) for k, v in numbers.items() if isinstance(v, int) and v >= 1024}
            nums = ", ".join(f"{key} {big.get(key, value)}" for key, value in numbers.items())
            lines.append(f"  numbers: {nums}")
        if (batch := advice.batch_of(f.numbers)) is not None:
            lines.append(f"  in flight: {advice.describe(batch)}")
        if f.kind.value == "config_error" and (fix := fix_line(r)):
            lines.append(f"  fix: {fix}")
        if run_dir is not None:
            lines.append(f"  log: {run_dir.attempt(r.attempt).log}")
    if (d := r.decision) is not None and r.restarts:
        changes = ", ".join(f"{key} {old} -> {new}" for key, (old, new) in d.changes.items()) or "no change"
        kept = f"{d.survives.value}; next attempt resumes at step {r.next_resume_from}, lost {r.lost_steps}"
        lines += [f"  retry: {d.rung}: {changes} ({d.why})", f"  progress kept: {kept} step(s)"]
    elif d is not None:
        lines.append(f"  gave up: {d.why}")
    return lines


def host_line(r: AttemptRecord) -> str | None:
    """The attempt's host RAM against the host model's prediction; None when nothing was read."""
    if (host := r.host) is None or (host.peak_bytes is None and host.load_peak_bytes is None):
        return None
    parts = []
    if host.peak_bytes is not None:
        predicted = f" (predicted {format_bytes(host.predicted_bytes)})" if host.predicted_bytes else ""
        parts.append(f"training peak {format_bytes(host.peak_bytes)}{predicted}")
    more = (("load peak", host.load_peak_bytes), ("last RSS", host.last_rss_bytes))
    parts += [f"{label} {format_bytes(size)}" for label, size in more if size is not None]
    return f"  host RAM: {', '.join(parts)}"


@dataclass(frozen=True)
class Running:
    """The attempt ``state.json`` names in flight (its journal line comes only when it ends) and what
    its heartbeats said last (None: no heartbeat yet, or no readable ``child-events.jsonl``)."""

    flight: journal.InFlight
    step: int | None
    stage: str | None
    tokens_per_s: float | None

    def to_json(self) -> dict[str, Any]:
        """The ``running`` object of ``status --json``."""
        return {
            "attempt": self.flight.number,
            "phase": self.flight.phase.value,
            "knobs": dataclasses.asdict(self.flight.knobs),
            "resumed_from": self.flight.resumed_from,
            "step": self.step,
            "stage": self.stage,
            "tokens_per_s": self.tokens_per_s,
            "pid": self.flight.pid,
            "alive": _alive(self.flight.pid),
            "started_at": self.flight.started_at,
        }

    def lines(self) -> list[str]:
        """What ``status`` prints for it: a head line like an attempt's, then its config and speed."""
        f = self.flight
        ago = max(0.0, time.time() - f.started_at)
        age = f"{ago:.0f} s" if ago < 120 else f"{ago / 60:.0f} min" if ago < 7200 else f"{ago / 3600:.1f} h"
        step = f"at step {self.step}" if self.step is not None else "no heartbeat yet"
        where = f" in {self.stage}" if self.stage else ""
        head = f"attempt {f.number} [{f.phase.value}] running: resumed at {f.resumed_from}, {step}{where}"
        child = f"pid {f.pid}" if _alive(f.pid) else f"its child, pid {f.pid}, is gone: the supervisor died?"
        lines = [f"{head}; since {age} ago ({child})", f"  config: {history.config_text(f.knobs)}"]
        if self.tokens_per_s is not None:
            lines.append(f"  speed: {self.tokens_per_s:,.0f} tokens/s (median of its heartbeats)")
        return lines


def running_attempt(rd: RunDir, state: journal.State | None, last_recorded: int) -> Running | None:
    """The attempt ``state`` names in flight, unless the journal already holds its line."""
    flight = state.in_flight if state is not None else None
    if flight is None or flight.number <= last_recorded:
        return None
    events = read_events(rd.attempt(flight.number).events)
    beat = next((event for event in reversed(events) if isinstance(event, Heartbeat)), None)
    speed = history.speed_of(events, flight.knobs).tokens_per_s
    return Running(flight, beat.step if beat else None, beat.stage.value if beat else None, speed)


def _alive(pid: int | None) -> bool:
    return pid is not None and psutil.pid_exists(pid)  # someone else's process of that number counts


def print_summary(rd: RunDir, out: TextIO) -> None:
    """What ``run`` and ``demo`` end with: the retry story, what the ladder changed, how to load it."""
    print("\n--- the retry story (qlora-supervise status) ---", file=out)
    print_story(rd, out)
    if not (train := [r for r in read_attempts(rd.attempts)[0] if r.phase is journal.Phase.TRAIN]):
        return
    last = train[-1].knobs
    changed = [f"{name} {old} -> {new}" for name, (old, new) in knob_changes(train[0].knobs, last).items()]
    print(f"changed by the ladder: {', '.join(changed) if changed else 'nothing'}", file=out)
    if not rd.adapter.exists():
        return
    adapter, merged = str(rd.adapter), str(rd.merged)
    lines = [
        "load the adapter (PEFT):",
        "  import torch",
        "  from peft import PeftModel",
        "  from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig",
        f"  base = AutoModelForCausalLM.from_pretrained({last.model!r}, device_map='auto',",
        "      quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4',",
        "          bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16))",
        f"  model = PeftModel.from_pretrained(base, {adapter!r})",
        f"  tokenizer = AutoTokenizer.from_pretrained({adapter!r})",
    ]
    if rd.merged.exists():
        lines += [
            "or the merged model (no PEFT needed):",
            f"  model = AutoModelForCausalLM.from_pretrained({merged!r}, dtype='auto', device_map='auto')",
        ]
    print("\n".join(lines), file=out)
