"""``qlora-supervise explain RUN_DIR [--json] [--plot FILE.png] [--model-config FILE]``: the retry
story as a table, one row per attempt, then why each attempt ran its config in the policy's words
(the first plan's reasons, or the decision after the attempt before). ``--json`` prints schema
``qlora-supervise.explain/1`` (docs/run-directory.md, "The JSON of status and explain").

The predicted peak is the memory model's for the attempt's knobs, from the model's ``config.json``
(``--model-config`` when the model directory is gone); it predicts the CUDA allocator's peak, so it
is left out for attempts that ran on the CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import Any, TextIO

import yaml
from tqdm import tqdm

from qlora_supervise.policies.memory_model import ModelShape, estimate_peak
from qlora_supervise.supervisor.commands import BadInput
from qlora_supervise.supervisor.commands.memory_plot import attempt_series, draw
from qlora_supervise.supervisor.facts.units import UnitError, format_bytes, parse_bytes
from qlora_supervise.supervisor.jobfile.bounds import json_loads
from qlora_supervise.supervisor.loop.settings import model_shape
from qlora_supervise.supervisor.record.history import (
    climb_back_lines,
    planned_restarts,
    speed_cell,
    speed_columns,
    speed_of,
    time_in_configs,
)
from qlora_supervise.supervisor.record.journal import AttemptRecord, read_attempts
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract.events import Started, read_events

SCHEMA = "qlora-supervise.explain/1"


def explain_command(
    run_dir: str,
    as_json: bool = False,
    plot: str | None = None,
    model_config: str | None = None,
    out: TextIO | None = None,
) -> int:
    out = out or sys.stdout  # at call time, like status
    rd = RunDir(Path(run_dir))
    if not rd.attempts.exists():
        raise BadInput(f"{run_dir}: no attempts.jsonl; pass a job's output_dir that has run")
    story = explanation(rd, Path(model_config) if model_config else None)
    if plot is not None:
        _check_plot_path(Path(plot))
        try:
            draw(rd, story, Path(plot))
        except OSError as error:  # a folder that takes no files (/proc), a full disk
            why = f"--plot {plot}: cannot write it ({error.strerror}); plot elsewhere"
            raise BadInput(why) from None
        print(f"wrote {plot}", file=sys.stderr)
    if as_json:
        print(json.dumps(story, indent=2), file=out)
    else:
        print_table(story, out)
    return 0


def _check_plot_path(path: Path) -> None:
    """``--plot`` into a folder that does not exist, or cannot be written, is exit 2 in words."""
    folder = path.absolute().parent
    why = None
    if not folder.is_dir():
        missing = "is not a folder" if folder.exists() else "does not exist"
        why = f"{folder} {missing}; create it first or plot elsewhere"
    elif not os.access(folder, os.W_OK | os.X_OK):
        why = f"{folder} is not writable; plot elsewhere"
    elif path.is_dir():
        why = "is a folder; give a file name (.png)"
    if why is not None:
        raise BadInput(f"--plot {path}: {why}")


def explanation(rd: RunDir, model_config: Path | None = None) -> dict[str, Any]:
    """The run's attempts as plain values (the JSON schema above)."""
    records, _ = read_attempts(rd.attempts)
    job = _job_copy(rd)
    budget = _budget(job)
    given = _shape_of(model_config) if model_config else None
    asked_gpu = str((job.get("resources") or {}).get("gpu", "auto")) != "cpu"
    rows = [
        {**_row(rd, r, given, asked_gpu), "why": _config_why(r, before)}
        for before, r in zip([None, *records], records, strict=False)
    ]
    return {
        "schema": SCHEMA,
        "run_dir": str(rd.root),
        "budget_bytes": budget,
        "started_at": records[0].started_at if records else None,
        "attempts": rows,
        "planned_restarts": planned_restarts(records),  # {"step_up": n, "retime": n}
        "time_in_configs": [c.to_json() for c in time_in_configs(records)],
    }


def _job_copy(rd: RunDir) -> dict[str, Any]:
    # The copy, read as plain YAML: its model and data may be gone (a run from another machine).
    try:
        raw = yaml.safe_load(rd.job_copy.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _budget(job: dict[str, Any]) -> int | None:
    resources = job.get("resources") or {}
    limits = [resources[k] for k in ("gpu_memory_limit", "cpu_memory_limit") if resources.get(k) is not None]
    with contextlib.suppress(UnitError):
        return parse_bytes(limits[0]) if limits else None
    return None


def _shape_of(config: Path) -> ModelShape:
    try:
        shape = ModelShape.from_config(json_loads(config.read_text(encoding="utf-8")))
    except (OSError, ValueError) as error:
        raise BadInput(f"--model-config {config}: {error}") from None
    if shape is None:
        raise BadInput(
            f"--model-config {config}: not a shape the memory model reads (see `qlora-supervise plan`)",
        )
    return shape


def _row(rd: RunDir, r: AttemptRecord, given: ModelShape | None, asked_gpu: bool) -> dict[str, Any]:
    f, d = r.failure, r.decision
    events = read_events(rd.attempt(r.attempt).events)
    # The child's ``started`` names the device (``gpu: auto`` on a machine without one runs on the
    # CPU); the job's ``gpu`` where the child never said.
    device = next((e.device for e in events if isinstance(e, Started) and e.device is not None), None)
    on_gpu = asked_gpu if device is None else device.startswith("cuda")
    shape = given or model_shape(Path(r.knobs.model))
    predicted = estimate_peak(shape, r.knobs) if shape is not None and on_gpu else None
    speed = speed_of(events, r.knobs)
    return {
        "attempt": r.attempt,
        "phase": r.phase.value,
        "outcome": r.outcome.value,
        "kind": f.kind.value if f else None,
        "stage": f.stage.value if f else None,
        "numbers": f.numbers_json() if f else {},
        "rung": d.rung if d is not None and r.restarts else None,
        "changes": {k: list(v) for k, v in d.changes.items()} if d is not None else {},
        "progress_kept": d.survives.value if d is not None and r.restarts else None,
        "steps": [r.resumed_from, r.steps_completed],
        "lost_steps": r.lost_steps,
        "peak_bytes": r.peak.bytes if r.peak else None,
        "peak_source": r.peak.source.value if r.peak else None,
        "predicted_peak_bytes": predicted,
        "host_peak_bytes": r.host.peak_bytes if r.host else None,
        "host_predicted_bytes": r.host.predicted_bytes if r.host else None,
        "host_load_peak_bytes": r.host.load_peak_bytes if r.host else None,
        **speed_columns(shape if on_gpu else None, speed),
        "wall_s": round(r.ended_at - r.started_at, 1),
        "started_at": r.started_at,
        "ended_at": r.ended_at,
        "samples": len(attempt_series(rd, r.attempt).points),
    }


def _config_why(r: AttemptRecord, before: AttemptRecord | None) -> list[str]:
    """The first plan's reasons for the config ``r`` ran, or the decision after the attempt before."""
    if r.plan is not None:
        return list(r.plan.why)
    return [before.decision.why] if before is not None and before.decision is not None else []


#: The numbers that tell each kind's story (the JSON keeps them all).
_KEY_NUMBERS = {
    "oom_fragmentation": ("tried_to_allocate", "reserved_unallocated"),
    "oom_contention": ("tried_to_allocate", "others_in_use"),
}
_DEFAULT_KEYS = ("tried_to_allocate", "allowed")
_SHORT = {"tried_to_allocate": "asked", "reserved_unallocated": "reserved-free", "others_in_use": "others"}


def _measured(measured: int | None, predicted: int | None) -> str:
    """``measured (predicted)``; ``?`` where nothing was measured."""
    cell = format_bytes(measured) if measured else "?"
    return cell + (f" ({format_bytes(predicted)})" if predicted else "")


def print_table(story: dict[str, Any], out: TextIO) -> None:
    """A fixed-width table, one row per attempt, then the budget."""
    header: tuple[str, ...] = ("#", "outcome", "stage", "key numbers", "change", "kept", "steps")
    header += ("peak (pred)", "host (pred)", "tok/s (pred)", "wall")
    rows: list[tuple[str, ...]] = [header]
    for a in story["attempts"]:
        keys = _KEY_NUMBERS.get(a["kind"] or "", _DEFAULT_KEYS)
        numbers = ", ".join(
            f"{_SHORT.get(k, k)} {format_bytes(a['numbers'][k])}" for k in keys if k in a["numbers"]
        )
        rows.append(
            (
                str(a["attempt"]),
                a["kind"] or a["outcome"],
                a["stage"] or "-",
                numbers or "-",
                a["rung"] or ("-" if a["outcome"] == "succeeded" else "gave up"),
                a["progress_kept"] or "-",
                f"{a['steps'][0]}->{a['steps'][1]}" + (f" -{a['lost_steps']}" if a["lost_steps"] else ""),
                _measured(a["peak_bytes"], a["predicted_peak_bytes"]),
                _measured(a["host_peak_bytes"], a["host_predicted_bytes"]) if a["host_peak_bytes"] else "?",
                speed_cell(a),
                tqdm.format_interval(a["wall_s"]),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines += [
        f"why #{a['attempt']} ran its config: {'; '.join(a['why'])}" for a in story["attempts"] if a["why"]
    ]
    budget = story["budget_bytes"]
    lines.append(f"budget: {format_bytes(budget) if budget else 'none (the card)'}")
    lines += climb_back_lines(story.get("planned_restarts") or {}, story.get("time_in_configs") or [])
    print("\n".join(lines), file=out)
