"""``qlora-supervise explain RUN_DIR [--json] [--plot FILE.png] [--model-config FILE]``: the retry story as a
table, one row per attempt, then why each attempt ran its config in the policy's words (the first plan's
reasons, or the decision after the attempt before). ``--json`` prints schema ``qlora-supervise.explain/1``
(docs/run-directory.md, "The JSON of status and explain"). The predicted peak is the memory model's for the
attempt's knobs, from the model's ``config.json`` (``--model-config`` when the model directory is gone); it
predicts the CUDA allocator's peak, so it is left out for attempts that ran on the CPU. ``--plot``: every
attempt's memory (what its cap limits) on one time axis, with NVML's view, the failures, the rungs, the budget
and the prediction; matplotlib (headless) is imported only when a plot is drawn."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

import yaml
from tqdm import tqdm

from qlora_supervise.policies.memory_model import ModelShape, estimate_peak
from qlora_supervise.supervisor.commands import BadInput
from qlora_supervise.supervisor.facts.units import UnitError, format_bytes, parse_bytes
from qlora_supervise.supervisor.jobfile.bounds import json_loads
from qlora_supervise.supervisor.loop.settings import model_shape
from qlora_supervise.supervisor.record import history
from qlora_supervise.supervisor.record.journal import AttemptRecord, read_attempts
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract import events as child

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
        path, folder = Path(plot), Path(plot).absolute().parent
        if not folder.is_dir():
            missing = "is not a folder" if folder.exists() else "does not exist"
            raise BadInput(f"--plot {path}: {folder} {missing}; create it first or plot elsewhere")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise BadInput(f"--plot {path}: {folder} is not writable; plot elsewhere")
        if path.is_dir():
            raise BadInput(f"--plot {path}: is a folder; give a file name (.png)")
        try:
            draw(rd, story, Path(plot))
        except OSError as error:  # a folder that takes no files (/proc), a full disk
            raise BadInput(f"--plot {plot}: cannot write it ({error.strerror}); plot elsewhere") from None
        print(f"wrote {plot}", file=sys.stderr)
    if as_json:
        print(json.dumps(story, indent=2), file=out)
    else:
        print_table(story, out)
    return 0


def explanation(rd: RunDir, model_config: Path | None = None) -> dict[str, Any]:
    """The run's attempts as plain values (the JSON schema above)."""
    records, _ = read_attempts(rd.attempts)
    # The job copy, read as plain YAML: its model and data may be gone (a run from another machine).
    job: Any = {}
    with contextlib.suppress(OSError, yaml.YAMLError):
        job = yaml.safe_load(rd.job_copy.read_text(encoding="utf-8"))
    resources = (job if isinstance(job, dict) else {}).get("resources") or {}
    limits = [resources[k] for k in ("gpu_memory_limit", "cpu_memory_limit") if resources.get(k) is not None]
    budget = None
    with contextlib.suppress(UnitError):
        budget = parse_bytes(limits[0]) if limits else None
    given = None
    if model_config:
        try:
            given = ModelShape.from_config(json_loads(model_config.read_text(encoding="utf-8")))
        except (OSError, ValueError) as error:
            raise BadInput(f"--model-config {model_config}: {error}") from None
        if given is None:
            why = "not a shape the memory model reads (see `qlora-supervise plan`)"
            raise BadInput(f"--model-config {model_config}: {why}")
    asked_gpu = str(resources.get("gpu", "auto")) != "cpu"
    rows = [_row(rd, r, prev, given, asked_gpu) for prev, r in zip([None, *records], records, strict=False)]
    return {
        "schema": SCHEMA,
        "run_dir": str(rd.root),
        "budget_bytes": budget,
        "started_at": records[0].started_at if records else None,
        "attempts": rows,
        "planned_restarts": history.planned_restarts(records),  # {"step_up": n, "retime": n}
        "time_in_configs": [c.to_json() for c in history.time_in_configs(records)],
    }


def _row(
    rd: RunDir, r: AttemptRecord, before: AttemptRecord | None, given: ModelShape | None, asked_gpu: bool
) -> dict[str, Any]:
    """One attempt; ``why``: the first plan's reasons for its config, or the decision after ``before``."""
    f, d = r.failure, r.decision
    why = [before.decision.why] if before is not None and before.decision is not None else []
    events = child.read_events(rd.attempt(r.attempt).events)
    # The child's ``started`` names the device (``gpu: auto`` on a machine without one runs on the
    # CPU); the job's ``gpu`` where the child never said.
    device = next((e.device for e in events if isinstance(e, child.Started) and e.device is not None), None)
    on_gpu = asked_gpu if device is None else device.startswith("cuda")
    shape = given or model_shape(Path(r.knobs.model))
    predicted = estimate_peak(shape, r.knobs) if shape is not None and on_gpu else None
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
        **history.speed_columns(shape if on_gpu else None, history.speed_of(events, r.knobs)),
        "wall_s": round(r.ended_at - r.started_at, 1),
        "started_at": r.started_at,
        "ended_at": r.ended_at,
        "samples": len(attempt_series(rd, r.attempt).points),
        "why": list(r.plan.why) if r.plan is not None else why,
    }


#: The numbers that tell each kind's story (the JSON keeps them all).
_KEY_NUMBERS = {
    "oom_fragmentation": ("tried_to_allocate", "reserved_unallocated"),
    "oom_contention": ("tried_to_allocate", "others_in_use"),
}
_DEFAULT_KEYS = ("tried_to_allocate", "allowed")
_SHORT = {"tried_to_allocate": "asked", "reserved_unallocated": "reserved-free", "others_in_use": "others"}


def _measured(measured: int | None, predicted: int | None) -> str:
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
        change = a["rung"] or ("-" if a["outcome"] == "succeeded" else "gave up")
        steps = f"{a['steps'][0]}->{a['steps'][1]}" + (f" -{a['lost_steps']}" if a["lost_steps"] else "")
        peak = _measured(a["peak_bytes"], a["predicted_peak_bytes"])
        host = _measured(a["host_peak_bytes"], a["host_predicted_bytes"]) if a["host_peak_bytes"] else "?"
        row = (str(a["attempt"]), a["kind"] or a["outcome"], a["stage"] or "-", numbers or "-", change)
        wall = tqdm.format_interval(a["wall_s"])
        rows.append((*row, a["progress_kept"] or "-", steps, peak, host, history.speed_cell(a), wall))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines += [
        f"why #{a['attempt']} ran its config: {'; '.join(a['why'])}" for a in story["attempts"] if a["why"]
    ]
    budget = story["budget_bytes"]
    lines.append(f"budget: {format_bytes(budget) if budget else 'none (the card)'}")
    lines += history.climb_back_lines(story.get("planned_restarts") or {}, story.get("time_in_configs") or [])
    print("\n".join(lines), file=out)


_GIB = 2**30
#: A label beside its point, in points.
_NOTE = {"textcoords": "offset points", "fontsize": 8}
#: The current gauge that shows the memory each peak source measures, and its label.
_GAUGE_OF_SOURCE = {
    child.ChildPeakSource.CUDA_ALLOCATOR: ("allocated_bytes", "CUDA allocated"),
    child.ChildPeakSource.DATA_SEGMENT: ("vmdata_bytes", "data segment"),
    child.ChildPeakSource.RSS: ("rss_bytes", "RSS"),
}


@dataclass
class Series:
    """(wall time, bytes) points of one attempt; ``nvml`` from the GPU monitor, when it ran."""

    points: list[tuple[float, int]] = field(default_factory=list)
    nvml: list[tuple[float, int]] = field(default_factory=list)
    label: str = "memory"


def attempt_series(rd: RunDir, attempt: int) -> Series:
    """The attempt's memory over time: its events' gauge of their peak source, and ``gpu.jsonl`` (NVML's
    view, CUDA context included). A missing or torn file gives fewer points, never an error."""
    files = rd.attempt(attempt)
    series = Series()
    samples = [e for e in child.read_events(files.events) if isinstance(e, child.Heartbeat | child.Loaded)]
    for event in samples:
        if event.time is None or not event.memory.peak_source:
            continue
        gauge, label = _GAUGE_OF_SOURCE[event.memory.peak_source]
        if value := getattr(event.memory, gauge):
            series.points.append((event.time, int(value)))
            series.label = label
    with contextlib.suppress(OSError):
        for line in files.gpu.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError, AttributeError):  # a torn line; a line not an object
                sample = json.loads(line)
                when, used = sample.get("time"), sample.get("this_process_bytes")
                if isinstance(when, int | float) and isinstance(used, int):
                    series.nvml.append((float(when), used))
    return series


def draw(rd: RunDir, story: dict[str, Any], path: Path) -> None:
    """Write the figure to ``path`` (PNG): one layer per helper, in drawing order."""
    try:
        import matplotlib
    except ImportError:
        why = "pip install -e '.[plot]' (the clone) or pip install matplotlib"
        raise BadInput(f"explain --plot needs matplotlib: {why}") from None
    matplotlib.use("Agg")  # headless: a lab server has no display
    import matplotlib.pyplot as plt

    attempts = story["attempts"]
    biggest = max([story["budget_bytes"] or 0, *[a["peak_bytes"] or 0 for a in attempts]])
    unit, scale = ("GiB", _GIB) if biggest >= 2 * _GIB else ("MiB", 2**20)
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=110)
    colors = plt.get_cmap("tab10").colors  # type: ignore[attr-defined]  # a ListedColormap: it has them
    budget = (story["budget_bytes"] or 0) / scale
    # A wild prediction (an attempt the model knew would not fit) must not squash the rest.
    ceiling = 1.8 * budget if budget else None
    top = budget
    t0 = story["started_at"] or 0.0
    for i, a in enumerate(attempts):
        top = max(top, _attempt(ax, rd, a, t0, scale, colors[i % len(colors)], ceiling))
    if budget:
        ax.axhline(budget, color="red", ls="--", lw=1.2, label=f"budget {budget:.2f} {unit}")
    if any(a["predicted_peak_bytes"] for a in attempts):
        ax.plot([], [], ls="dotted", color="gray", label="predicted peak (memory model)")
    if any(a["outcome"] == "failed" for a in attempts):
        died = "died here: held + the failed request"
        ax.plot([], [], marker="x", mew=2.5, color="red", ls="none", label=died)
    ax.set_ylim(0, (top * 1.15) or 1)
    ax.set_xlim(left=0)
    ax.set(xlabel="minutes since the run started", ylabel=f"memory ({unit})")
    run = Path(story["run_dir"]).resolve()
    ax.set_title(f"{run.parent.name}/{run.name}: memory of each attempt (what its cap limits)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _attempt(
    ax: Any, rd: RunDir, a: dict[str, Any], t0: float, scale: float, color: Any, ceiling: float | None
) -> float:
    """One attempt's band, series, prediction, failure mark and rung label; returns its height."""
    series = attempt_series(rd, a["attempt"])
    start, end = (a["started_at"] - t0) / 60, (a["ended_at"] - t0) / 60
    ax.axvspan(start, end, color=color, alpha=0.06)
    label = f"attempt {a['attempt']}: {a['kind'] or a['outcome']}"
    ys = [b / scale for _, b in series.points]
    top = 0.0
    if ys:
        xs = [(t - t0) / 60 for t, _ in series.points]
        ax.plot(xs, ys, color=color, lw=2, marker="o", ms=3, label=f"{label} ({series.label})")
        top = max(ys)
    elif a["peak_bytes"]:  # no samples kept: the journal's peak, over the attempt
        ax.hlines(a["peak_bytes"] / scale, start, end, colors=[color], lw=2.5, label=f"{label} (peak only)")
        top = a["peak_bytes"] / scale
    if series.nvml:
        nx = [(t - t0) / 60 for t, _ in series.nvml]
        ax.plot(nx, [b / scale for _, b in series.nvml], color=color, lw=0.8, alpha=0.6)
    if predicted := a["predicted_peak_bytes"]:
        value = float(predicted) / scale
        if ceiling is not None and value > ceiling:
            where = {"xy": ((start + end) / 2, ceiling), "ha": "center", "va": "bottom"}
            ax.annotate(f"predicted {value:.1f} ↑ (off the scale)", fontsize=8, color=color, **where)
            value = ceiling
        ax.hlines(value, start, end, colors=[color], linestyles="dotted", lw=1.5)
        top = max(top, value)
    if a["outcome"] == "failed":
        # Where it died: what it held (the allocator's reserve, which a cap counts, else its allocated bytes,
        # else the last sample) plus the failed request: a cross above the budget shows by how much.
        numbers = a["numbers"]
        held = (
            numbers.get("reserved_total") or numbers.get("already_allocated") or numbers.get("process_in_use")
        )
        last = ys[-1] if ys else (a["peak_bytes"] or 0) / scale
        y = (held / scale if held else last) + (numbers.get("tried_to_allocate") or 0) / scale
        mark = "red" if (a["kind"] or "").startswith("oom") or a["kind"] == "host_oom" else "black"
        ax.plot([end], [y], marker="x", ms=11, mew=2.5, color=mark, ls="none")
        ax.annotate(a["kind"] or "failed", xy=(end, y), xytext=(7, 3), ha="left", color=mark, **_NOTE)
        top = max(top, y)
    if a["rung"]:
        # At the foot of the gap between attempts, below the data and clear of the failure marks.
        rung = f"retry: {a['rung']}"
        ax.annotate(rung, xy=(end, 0), xytext=(3, 6), rotation=90, va="bottom", color="dimgray", **_NOTE)
    return top
