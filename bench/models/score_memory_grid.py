"""Re-score a recorded memory grid with the CURRENT memory model; no GPU needed.

    python -m bench.models.score_memory_grid bench/results/memory-grid-h200-2026-12-01/memory-grid.json
    python -m bench.models.score_memory_grid RESULTS.json --components     # each point's terms too

bench/models/memory_grid.py stores, for every config it ran, the measured peaks
(``torch.cuda.max_memory_allocated`` / ``_reserved``) and the prediction of the model as it was
then. This script reads the shapes from the same bench script (``SHAPES``), predicts every
recorded point again with the model in this checkout, and prints measured against the new
prediction (and against the recorded one), so a change to the model can be judged against
every measurement without running anything. Exit status 1 when the targets of issue 8 (median
|error| <= 5 %, worst <= 15 %) are missed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from qlora_supervise.policies import memory_model
from qlora_supervise.policies.memory import gpu

from .memory_grid import SHAPES, Config

GiB = 1 << 30
MEDIAN_TARGET, WORST_TARGET = 0.05, 0.15


#: ``--attention MODEL_TYPE=IMPL``: the attention a grid's children ran with, for grids recorded
#: before the bench kept the child's ``attn_implementation`` (the transformers there may choose
#: otherwise than the one here; see policies/memory/families.py).
ATTENTION: dict[str, str] = {}


def shape_of(name: str, attention: str | None = None) -> memory_model.ModelShape:
    """The bench's shape ``name`` as the model reads it from its config.json, with the attention
    the point ran with where that is known."""
    shape = memory_model.ModelShape.read({"architectures": ["LlamaForCausalLM"], **SHAPES[name]})
    if not isinstance(shape, memory_model.ModelShape):
        raise SystemExit(f"bench shape {name}: {shape.detail}")
    ran_with = attention or ATTENTION.get(shape.model_type)
    return dataclasses.replace(shape, attn_implementation=ran_with) if ran_with else shape


def point_shape(point: dict[str, Any]) -> memory_model.ModelShape:
    """The shape a recorded point ran, with the attention its child reported where it did."""
    return shape_of(point["config"]["shape"], point.get("attn_implementation"))


def repredict(point: dict[str, Any]) -> memory_model.Prediction:
    """The current model's prediction for one recorded grid point."""
    config = Config(**point["config"])
    return memory_model.predict(point_shape(point), config.knobs(), targets=config.target_modules)


def load_line(point: dict[str, Any]) -> str | None:
    """The load phase against the child's peak when it reported ``loaded`` (model + adapter, before
    the trainer), where the grid recorded it; None for grids run before the bench read that field."""
    measured = point.get("loaded_peak")
    if not measured:
        return None
    config = Config(**point["config"])
    load = sum(gpu.load_components(point_shape(point), config.knobs(), config.target_modules).values())
    error = (load - measured) / measured
    return f"      load: measured {measured / GiB:.2f}, predicted {load / GiB:.2f} ({error:+.1%})"


def rows(points: list[dict[str, Any]], components: bool) -> tuple[list[str], list[float]]:
    """The table's lines and the new |errors| of the points that finished."""
    head = f"{'config':<56}  {'measured':>8}  {'recorded':>8}  {'was':>7}  {'now':>8}  {'error':>7}  phase"
    lines, errors = [head, "-" * len(head)], []
    for point in sorted(points, key=lambda p: p["name"]):
        measured = point.get("max_allocated")
        if not measured or point.get("exit_code") != 0:
            lines.append(f"{point['name']:<56}  (no measurement: exit {point.get('exit_code')})")
            continue
        prediction = repredict(point)
        recorded = (point.get("predicted") or {}).get("peak_allocated") or 0
        was = (recorded - measured) / measured if recorded else float("nan")
        now = (prediction.peak_bytes - measured) / measured
        errors.append(abs(now))
        lines.append(
            f"{point['name']:<56}  {measured / GiB:>8.2f}  {recorded / GiB:>8.2f}  {was:>+7.1%}  "
            f"{prediction.peak_bytes / GiB:>8.2f}  {now:>+7.1%}  {prediction.phase}"
        )
        if (load := load_line(point)) is not None:
            lines.append(load)
        if components:
            lines += [f"      {k:<22} {v / GiB:8.3f}" for k, v in prediction.components.items()]
    return lines, errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", type=Path, help="memory-grid.json written by bench/models/memory_grid.py")
    parser.add_argument("--components", action="store_true", help="print each prediction's components")
    parser.add_argument(
        "--attention", action="append", default=[], metavar="MODEL_TYPE=IMPL",
        help="the attention a model type ran with where the grid did not record it (gemma2=sdpa)",
    )  # fmt: skip
    parser.add_argument("--median", type=float, default=MEDIAN_TARGET, help="median |error| target")
    parser.add_argument("--worst", type=float, default=WORST_TARGET, help="worst |error| target")
    args = parser.parse_args(argv)
    ATTENTION.clear()  # this call's overrides only
    for item in args.attention:
        model_type, _, impl = item.partition("=")
        if impl not in ("sdpa", "eager"):
            parser.error(f"--attention {item}: write MODEL_TYPE=sdpa or MODEL_TYPE=eager")
        ATTENTION[model_type] = impl
    try:
        report = json.loads(args.results.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        print(f"score_memory_grid: cannot read {args.results}: {error}", file=sys.stderr)
        return 2
    status = 0
    for key in ("grid", "rungs"):
        if not report.get(key):
            continue
        lines, errors = rows(report[key], args.components)
        print(f"== {key} ==", *lines, sep="\n")
        if errors:
            median, worst = statistics.median(errors), max(errors)
            print(f"{len(errors)} points: median |error| {median:.1%}, worst {worst:.1%}\n")
            status |= median > args.median or worst > args.worst
    return int(status)


if __name__ == "__main__":
    sys.exit(main())
