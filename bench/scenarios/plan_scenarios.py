"""Does the pre-flight start from a config that fits? Over-ambitious QLoRA jobs on capped H200 memory.

    python -m bench.scenarios.plan_scenarios --out OUT [--work /tmp/memory_grid] [--parallel 3]
        [--deadline-s 480]
    python -m bench.scenarios.plan_scenarios --out /tmp/s --tiny  # the same pipeline on the CPU (tiny model)
    python -m bench.scenarios.plan_scenarios --out OUT --set families   # issue 20: two jobs per model family

Each scenario is a job file as a user would write it (no checkpointing, a large micro-batch,
32-bit AdamW or long context) on an emulated smaller card (``gpu_memory_limit``), run by the real
``qlora-supervise run`` (pre-flight on) with a wall-clock limit. Models are the random-weight
shapes of ``bench/models/memory_grid.py`` (built there once, reused from ``--work``). Per scenario it
reports the attempts, OOMs, the config attempt 1 started from and why (the journal's plan), the
rungs taken after a failure, whether any quality knob (seq_len, rank, model) changed, steps
lost, the effective batch, and the final tokens/s. The summary line gives the issue's targets:
share of scenarios with no OOM (>= 80 %), mean attempts (<= 1.5), quality rungs taken.

Writes ``OUT/scenarios.json``, ``OUT/table.txt`` and each run's journal under ``OUT/<name>/``.
Not a test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models import memory_grid
from . import gpu_ladder

QUALITY = ("max_seq_len", "lora_r", "model")


@dataclass(frozen=True)
class Scenario:
    name: str
    shape: str
    cap: str
    seq: int
    micro: int
    effective: int
    optimizer: str = "paged_adamw_8bit"
    r: int = 8


SCENARIOS = (
    Scenario("7b-8GiB", "7b-32k", "8GiB", 2048, 4, 16, "adamw_torch", 16),
    Scenario("7b-16GiB", "7b-32k", "16GiB", 2048, 4, 16, "adamw_torch", 16),
    Scenario("7b-24GiB", "7b-32k", "24GiB", 2048, 4, 16, "adamw_torch", 16),
    Scenario("7b-32GiB", "7b-32k", "32GiB", 2048, 4, 16, "adamw_torch", 16),
    Scenario("1b-128k-12GiB", "1b-128k", "12GiB", 4096, 4, 16),
    Scenario("8b-128k-24GiB", "8b-128k", "24GiB", 4096, 2, 16),
    Scenario("7b-long-16GiB", "7b-32k", "16GiB", 8192, 2, 8),
    Scenario("8b-128k-16GiB", "8b-128k", "16GiB", 2048, 4, 16, "adamw_torch", 16),
)
#: Issue 20: two jobs per family, each as written too big for its cap (memory_grid.FAMILY_SHAPES).
FAMILY_SCENARIOS = (
    Scenario("gemma2-8GiB", "gemma2-2b", "8GiB", 2048, 4, 16, "adamw_torch", 16),
    Scenario("gemma2-long-16GiB", "gemma2-2b", "16GiB", 8192, 2, 8),
    Scenario("gemma3-6GiB", "gemma3-1b", "6GiB", 4096, 4, 16, "adamw_torch", 16),
    Scenario("gemma3-long-12GiB", "gemma3-1b", "12GiB", 8192, 4, 16),
    Scenario("phi3-8GiB", "phi3-mini", "8GiB", 2048, 4, 16, "adamw_torch", 16),
    Scenario("phi3-long-16GiB", "phi3-mini", "16GiB", 8192, 2, 8),
    Scenario("qwen3-8GiB", "qwen3-4b", "8GiB", 2048, 4, 16, "adamw_torch", 16),
    Scenario("qwen3-long-16GiB", "qwen3-4b", "16GiB", 8192, 2, 8),
    Scenario("qwen3moe-16GiB", "qwen3moe-16x32", "16GiB", 2048, 4, 16, "adamw_torch", 16),
    Scenario("qwen3moe-long-24GiB", "qwen3moe-16x32", "24GiB", 8192, 2, 8),
)
TINY = (Scenario("tiny-cpu", "tiny", "8GiB", 256, 8, 16),)


def write_job(s: Scenario, assets: Path, run_dir: Path, tiny: bool, max_steps: int) -> Path:
    resources = (
        f"{{gpu: cpu, cpu_memory_limit: {s.cap}}}" if tiny else f"{{gpu: cuda:0, gpu_memory_limit: {s.cap}}}"
    )
    text = f"""\
model: {{path: {assets / "model"}}}
data: {{path: {assets / "data.jsonl"}, text_field: text}}
lora: {{r: {s.r}, alpha: {2 * s.r}, target_modules: attention}}
train:
  max_seq_len: {s.seq}
  micro_batch_size: {s.micro}
  effective_batch_size: {s.effective}
  gradient_checkpointing: false
  optimizer: {s.optimizer}
  max_steps: {max_steps}
  save_steps: 2
  logging_steps: 1
resources: {resources}
supervise: {{max_attempts: 8, hang_timeout: 5m, backoff_initial: 1s, backoff_max: 5s}}
output_dir: {run_dir}
"""
    path = run_dir.parent / f"{s.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def summarise(s: Scenario, run_dir: Path, run: dict[str, Any]) -> dict[str, Any]:
    attempts = gpu_ladder.read_jsonl(run_dir / "attempts.jsonl")
    ooms = [a for a in attempts if (a.get("failure") or {}).get("kind", "").startswith("oom_")]
    first = attempts[0] if attempts else {}
    last = attempts[-1] if attempts else {}
    written = {"max_seq_len": s.seq, "lora_r": s.r}
    knobs = last.get("knobs") or {}
    quality = [k for k in QUALITY if k in written and knobs.get(k) != written[k]]
    events = gpu_ladder.read_jsonl(run_dir / f"attempt-{len(attempts):03d}" / "child-events.jsonl")
    rates = [e["tokens_per_s"] for e in events if e.get("event") == "heartbeat" and e.get("tokens_per_s")]
    plan = first.get("plan") or {}
    loaded = next((e for e in events if e.get("event") == "loaded"), {})
    return {
        "scenario": s.name,
        "exit_code": run["exit_code"],
        "wall_s": run["wall_s"],
        "attempts": len(attempts),
        "ooms": len(ooms),
        "start": _knob_text(first.get("knobs") or {}),
        "plan_changes": plan.get("changes"),
        "plan_predicted_gib": round((plan.get("predicted_peak") or 0) / 2**30, 2),
        "rungs": [(a.get("decision") or {}).get("rung") for a in attempts if a.get("decision")],
        "final": _knob_text(knobs),
        "quality_changed": quality,
        "lost_steps": sum(int(a.get("lost_steps") or 0) for a in attempts),
        "effective_batch_kept": all(
            (a.get("knobs") or {}).get("micro_batch_size", 0) * (a.get("knobs") or {}).get("grad_accum", 0)
            == s.effective
            for a in attempts
        ),
        "attn_implementation": loaded.get("attn_implementation"),
        "peak_gib": round(((last.get("peak") or {}).get("bytes") or 0) / 2**30, 2),
        "tokens_per_s": round(statistics.median(rates[1:] or rates), 1) if rates else None,
    }


def _knob_text(k: dict[str, Any]) -> str:
    if not k:
        return "-"
    gc = "gc" if k.get("gradient_checkpointing") else "nogc"
    batch = f"b{k.get('micro_batch_size')}x{k.get('grad_accum')}"
    return f"s{k.get('max_seq_len')} {batch} {gc} {k.get('optimizer')}"


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = ("scenario", "exit", "att", "oom", "start", "final", "quality", "lost", "eff", "peak", "tok/s")
    widths = (15, 5, 4, 4, 34, 34, 12, 5, 5, 6, 8)
    lines = ["  ".join(f"{h:<{w}}" for h, w in zip(head, widths, strict=True))]
    for r in rows:
        kept = "kept" if r["effective_batch_kept"] else "CUT"
        quality = ",".join(r["quality_changed"]) or "-"
        cells = (r["scenario"], r["exit_code"], r["attempts"], r["ooms"], r["start"], r["final"], quality)
        cells += (r["lost_steps"], kept, r["peak_gib"], r["tokens_per_s"])
        lines.append("  ".join(f"{c!s:<{w}}" for c, w in zip(cells, widths, strict=True)))
    done = [r for r in rows if r["attempts"]]
    if done:
        clean = sum(1 for r in done if r["ooms"] == 0)
        lines.append(
            f"{len(done)} scenarios: {clean}/{len(done)} ({clean / len(done):.0%}) never hit an OOM, "
            f"mean attempts {statistics.mean(r['attempts'] for r in done):.2f}, "
            f"quality rungs taken {sum(1 for r in done if r['quality_changed'])}, "
            f"finished {sum(1 for r in done if r['exit_code'] == 0)}/{len(done)}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/memory_grid"))
    p.add_argument("--parallel", type=int, default=3)
    p.add_argument("--deadline-s", type=float, default=480.0)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--set", choices=("plan", "families"), default="plan", help="families: issue 20's")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run these scenarios of the set alone")
    args = p.parse_args(argv)
    start = time.monotonic()
    scenarios = TINY if args.tiny else {"plan": SCENARIOS, "families": FAMILY_SCENARIOS}[args.set]
    if args.only:
        unknown = sorted(set(args.only) - {s.name for s in scenarios})
        if unknown:
            named = "--tiny" if args.tiny else f"--set {args.set}"
            known = ", ".join(s.name for s in scenarios)
            p.error(f"no scenario {', '.join(unknown)} in {named} (it has: {known})")
        scenarios = tuple(s for s in scenarios if s.name in args.only)
    shapes = sorted({s.shape for s in scenarios})
    if args.tiny:
        from qlora_supervise.trainer_child.recipe.tiny import write_tiny

        if not (args.work / "tiny" / "model").is_dir():
            write_tiny(args.work / "tiny")
    else:
        print("build:", memory_grid.build_all(shapes, args.work, False, 8192), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)

    def one(s: Scenario) -> dict[str, Any]:
        assets = args.work / s.shape
        run_dir = args.out / s.name / "run"
        shutil.rmtree(run_dir, ignore_errors=True)
        job = write_job(s, assets, run_dir, args.tiny, args.max_steps)
        left = args.deadline_s - (time.monotonic() - start)
        run = gpu_ladder.run_supervised(job, args.out / s.name / "supervisor.log", left)
        row = summarise(s, run_dir, run)
        print("  done", json.dumps(row), flush=True)
        return row

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        rows = list(pool.map(one, scenarios))
    (args.out / "scenarios.json").write_text(json.dumps(rows, indent=2), encoding="utf-8")
    lines = table(rows)
    (args.out / "table.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    print(f"total {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
