"""An attempt's memory over time, and ``explain --plot FILE.png``: every attempt's on one time axis.

One colour per attempt: the memory its cap limits (CUDA allocated on a GPU, the data segment on
the CPU), NVML's view as a thin line; a failure is a cross at the bytes it needed, labelled with
its kind; the next attempt's rung labels the gap; the budget is a dashed red line, the memory
model's prediction a dotted one. matplotlib (headless) is imported only when a plot is drawn.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.commands import BadInput
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract.events import ChildPeakSource, Heartbeat, Loaded, read_events

_GIB = 2**30
#: A label beside its point, in points.
_NOTE = {"textcoords": "offset points", "fontsize": 8}
#: The current gauge that shows the memory each peak source measures, and its label.
_GAUGE_OF_SOURCE = {
    ChildPeakSource.CUDA_ALLOCATOR: ("allocated_bytes", "CUDA allocated"),
    ChildPeakSource.DATA_SEGMENT: ("vmdata_bytes", "data segment"),
    ChildPeakSource.RSS: ("rss_bytes", "RSS"),
}


@dataclass
class Series:
    """(wall time, bytes) points of one attempt; ``nvml`` from the GPU monitor, when it ran."""

    points: list[tuple[float, int]] = field(default_factory=list)
    nvml: list[tuple[float, int]] = field(default_factory=list)
    label: str = "memory"


def attempt_series(rd: RunDir, attempt: int) -> Series:
    """The attempt's memory over time from its ``child-events.jsonl`` (the heartbeats' and ``loaded``'s
    memory numbers: the gauge of its peak source) and ``gpu.jsonl`` (NVML's view of the process, CUDA
    context included). A missing or torn file gives fewer points, never an error."""
    files = rd.attempt(attempt)
    series = Series()
    for event in read_events(files.events):
        if not isinstance(event, Heartbeat | Loaded) or event.time is None:
            continue
        numbers = event.memory
        if numbers.peak_source is None:
            continue
        gauge, label = _GAUGE_OF_SOURCE[numbers.peak_source]
        if value := getattr(numbers, gauge):
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


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise BadInput(
            "explain --plot needs matplotlib: pip install -e '.[plot]' (the clone) or pip install matplotlib",
        ) from None
    matplotlib.use("Agg")  # headless: a lab server has no display
    import matplotlib.pyplot as plt

    return plt


def draw(rd: RunDir, story: dict[str, Any], path: Path) -> None:
    """Write the figure to ``path`` (PNG): one layer per helper, in drawing order."""
    plt = _pyplot()
    attempts = story["attempts"]
    unit, scale = _unit(story, attempts)
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=110)
    colors = plt.get_cmap("tab10").colors
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
        ax.plot(
            [], [], marker="x", mew=2.5, color="red", ls="none", label="died here: held + the failed request"
        )
    ax.set_ylim(0, (top * 1.15) or 1)
    ax.set_xlim(left=0)
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel(f"memory ({unit})")
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
    top = max(top, _prediction(ax, a, start, end, scale, color, ceiling))
    top = max(top, _mark_failure(ax, a, end, ys[-1] if ys else None, scale))
    if a["rung"]:
        # At the foot of the gap between attempts, below the data and clear of the failure marks.
        rung = f"retry: {a['rung']}"
        ax.annotate(rung, xy=(end, 0), xytext=(3, 6), rotation=90, va="bottom", color="dimgray", **_NOTE)
    return top


def _prediction(
    ax: Any, a: dict[str, Any], start: float, end: float, scale: float, color: Any, ceiling: float | None
) -> float:
    predicted = a["predicted_peak_bytes"]
    if not predicted:
        return 0.0
    value = float(predicted) / scale
    if ceiling is not None and value > ceiling:
        where = {"xy": ((start + end) / 2, ceiling), "ha": "center", "va": "bottom"}
        ax.annotate(f"predicted {value:.1f} ↑ (off the scale)", fontsize=8, color=color, **where)
        value = ceiling
    ax.hlines(value, start, end, colors=[color], linestyles="dotted", lw=1.5)
    return value


def _unit(story: dict[str, Any], attempts: list[dict[str, Any]]) -> tuple[str, float]:
    biggest = max([story["budget_bytes"] or 0, *[a["peak_bytes"] or 0 for a in attempts]])
    return ("GiB", _GIB) if biggest >= 2 * _GIB else ("MiB", 2**20)


def _mark_failure(ax: Any, a: dict[str, Any], end: float, last: float | None, scale: float) -> float:
    """A failure's cross and kind; returns the height it reached (for the y limit)."""
    if a["outcome"] != "failed":
        return 0.0
    # Where it died: what it held (the allocator's reserve, which a cap counts, else its allocated
    # bytes, else the last sample) plus the request that failed, so a cross above the budget line
    # shows by how much the attempt did not fit.
    numbers = a["numbers"]
    held = numbers.get("reserved_total") or numbers.get("already_allocated") or numbers.get("process_in_use")
    held_units = held / scale if held else (last if last is not None else (a["peak_bytes"] or 0) / scale)
    y = held_units + (numbers.get("tried_to_allocate") or 0) / scale
    oom = (a["kind"] or "").startswith("oom") or a["kind"] == "host_oom"
    mark = "red" if oom else "black"
    ax.plot([end], [y], marker="x", ms=11, mew=2.5, color=mark, ls="none")
    ax.annotate(a["kind"] or "failed", xy=(end, y), xytext=(7, 3), ha="left", color=mark, **_NOTE)
    return y
