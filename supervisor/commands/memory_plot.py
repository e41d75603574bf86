"""``explain --plot FILE.png``: every attempt's memory on one time axis (matplotlib, headless).

One colour per attempt; the line is the memory the attempt's cap limits (CUDA allocated on a
GPU, the data segment on the CPU), NVML's view of the process as a thin line where it ran. An
OOM is a red cross at the end of its attempt, at the bytes it needed when the message says
(in use + the request), with the failure kind beside it; the rung that the next attempt runs
with labels the gap between them. The budget is a dashed red line, the memory model's
prediction a dotted line over its attempt. Imported only by ``explain --plot``: the daemon
never loads matplotlib.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.commands.series import attempt_series
from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.supervisor.record.rundir import RunDir

_GIB = 2**30


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SupervisorExit(
            SupervisorExitCode.BAD_JOB,
            "explain --plot needs matplotlib: pip install -e '.[plot]' (the clone) or pip install matplotlib",
        ) from None
    matplotlib.use("Agg")  # headless: a lab server has no display
    import matplotlib.pyplot as plt

    return plt


def draw(rd: RunDir, story: dict[str, Any], path: Path) -> None:
    # One figure built in reading order (series, OOM marks, rung labels, budget, legend); split
    # into helpers it would hide which layer is drawn over which.
    plt = _pyplot()
    attempts = story["attempts"]
    t0 = story["started_at"] or 0.0
    unit, scale = _unit(story, attempts)
    fig, ax = plt.subplots(figsize=(11, 5.5), dpi=110)
    colors = plt.get_cmap("tab10").colors
    top = 0.0
    for i, a in enumerate(attempts):
        color = colors[i % len(colors)]
        series = attempt_series(rd, a["attempt"])
        xs = [(t - t0) / 60 for t, _ in series.points]
        ys = [b / scale for _, b in series.points]
        label = f"attempt {a['attempt']}: {a['kind'] or a['outcome']}"
        if xs:
            ax.plot(xs, ys, color=color, lw=2, marker="o", ms=3, label=f"{label} ({series.label})")
            top = max(top, *ys)
        else:
            ax.plot([], [], color=color, lw=2, label=f"{label} (no samples)")
        if series.nvml:
            ax.plot(
                [(t - t0) / 60 for t, _ in series.nvml],
                [b / scale for _, b in series.nvml],
                color=color,
                lw=0.8,
                alpha=0.6,
            )
        start, end = (a["started_at"] - t0) / 60, (a["ended_at"] - t0) / 60
        ax.axvspan(start, end, color=color, alpha=0.06)
        if a["predicted_peak_bytes"]:
            ax.hlines(
                a["predicted_peak_bytes"] / scale, start, end, colors=[color], linestyles="dotted", lw=1.5
            )
            top = max(top, a["predicted_peak_bytes"] / scale)
        top = max(top, _mark_failure(ax, a, end, ys[-1] if ys else None, scale))
        if a["rung"]:
            ax.annotate(
                f"-> {a['rung']}",
                xy=(end, 0),
                xytext=(3, 6),
                textcoords="offset points",
                rotation=90,
                va="bottom",
                fontsize=8,
                color="dimgray",
            )
    budget = story["budget_bytes"]
    if budget:
        ax.axhline(budget / scale, color="red", ls="--", lw=1.2, label=f"budget {budget / scale:.2f} {unit}")
        top = max(top, budget / scale)
    ax.plot([], [], ls="dotted", color="gray", label="predicted peak (memory model)")
    ax.set_ylim(0, top * 1.15 or 1)
    ax.set_xlim(left=0)
    ax.set_xlabel("minutes since the run started")
    ax.set_ylabel(f"memory ({unit})")
    ax.set_title(f"{Path(story['run_dir']).name}: memory per attempt")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _unit(story: dict[str, Any], attempts: list[dict[str, Any]]) -> tuple[str, float]:
    biggest = max([story["budget_bytes"] or 0, *[a["peak_bytes"] or 0 for a in attempts]])
    return ("GiB", _GIB) if biggest >= 2 * _GIB else ("MiB", 2**20)


def _mark_failure(ax: Any, a: dict[str, Any], end: float, last: float | None, scale: float) -> float:
    """An OOM's cross and kind; returns the height it reached (for the y limit)."""
    if a["outcome"] != "failed":
        return 0.0
    numbers = a["numbers"]
    in_use = numbers.get("already_allocated") or numbers.get("process_in_use")
    needed = (in_use or 0) + (numbers.get("tried_to_allocate") or 0) if in_use else None
    y = needed / scale if needed else (last if last is not None else (a["peak_bytes"] or 0) / scale)
    oom = (a["kind"] or "").startswith("oom") or a["kind"] == "host_oom"
    ax.plot([end], [y], marker="x", ms=11, mew=2.5, color="red" if oom else "black", ls="none")
    ax.annotate(
        a["kind"] or "failed",
        xy=(end, y),
        xytext=(-4, 8),
        textcoords="offset points",
        ha="right",
        fontsize=8,
        color="red" if oom else "black",
    )
    return y
