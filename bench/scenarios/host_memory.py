"""Host memory in the plan (issue 28): offload jobs of four families, four at a time on one host.

    python -m bench.scenarios.host_memory --out OUT [--work /tmp/memory_grid]   # H200, ~6 min
    python -m bench.scenarios.host_memory --out OUT --set greedy                # H200, ~3 min
    python -m bench.scenarios.host_memory --out /tmp/hm --tiny --only qwen3     # the pipeline on the CPU

Each job is written as a user writes it (micro-batch 4 or 2, no checkpointing, 32-bit AdamW) on an
emulated small card (``gpu_memory_limit``), where the plan starts it with activation offload, and
with ``resources.host_memory_limit`` set to what its host model predicts plus about 15 %, so that
the four limits together fit the machine. The four run side by side through the real
``qlora-supervise run`` (pre-flight and speed trial on). Random-weight models of the released
widths are built with ``bench/models/memory_grid.py`` (reused from ``--work``).

Per job: the config attempt 1 started from; attempts, host OOM kills, quality changes; the host
model's training host peak for the knobs trained (``policies/memory/host.py``) against the child's
measured RSS high-water mark in training (the child restarts VmHWM after the load and after the
speed trial, so it is training's own), and the load's predicted peak against its measured one; each
speed-trial candidate's measured host peak against its prediction; the machine's used RAM at its
highest while the four ran. And the plan's answer for the 8 GB-card user (Llama-3-8B, seq 2048).

``--set greedy``: the job that took the host before issue 28 (Llama-3-8B shape, seq 4096,
micro-batch 4, no checkpointing, 32-bit AdamW, an 8 GiB card) with no host limit in the job: the
budget is what the machine has available less a reserve, and the run must start, trial and train
without offloading every activation of a micro-batch.

``--load-split``: what the load's RSS peak is made of, for the 8B (the 8 GB-card user's model):
the recipe's own 4-bit load in a child process that reads /proc/self/status every 20 ms, peak
``RssAnon`` (what the process allocated) and ``RssFile`` (the checkpoint's mapped pages, which the
kernel can drop and read again) apart.

Writes ``OUT/results.json`` and ``OUT/table.txt`` (each run's journal stays under ``--work``). Not a test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil

from qlora_supervise.policies.memory.host import host_train_need
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.trainer_child.contract.spec import Knobs

from ..models import memory_grid
from . import gpu_ladder

GiB = 1 << 30
QUALITY = ("max_seq_len", "lora_r", "model")
#: The target of the issue: predicted training host peak within 10 % of the measured RSS.
TOLERANCE = 0.10


@dataclass(frozen=True)
class Job:
    """One job as a user writes it; ``cap`` emulates the card; ``host_limit`` is its host budget."""

    name: str
    family: str
    shape: str
    cap: str
    host_limit: str | None  # None: the run's default (available now, less a reserve)
    seq: int = 2048
    micro: int = 4
    effective: int = 8
    optimizer: str = "adamw_torch"
    r: int = 16


#: Caps found with the plan (policies/search/config_search.py) where each starts with offload and
#: checkpointing; host limits: the load's predicted peak (the larger) plus about 15 %, summing to 45 GiB.
JOBS = (
    Job("llama3-8b-7GiB", "llama", "8b-128k", "7GiB", "19GiB"),
    Job("qwen3-4b-5GiB", "qwen3", "qwen3-4b", "5GiB", "11GiB"),
    Job("phi3-mini-5GiB", "phi3", "phi3-mini", "5GiB", "10GiB"),
    Job("gemma3-1b-3GiB", "gemma3", "gemma3-1b", "3GiB", "5GiB", seq=4096, micro=2),
)
GREEDY = (Job("llama3-8b-s4096-8GiB", "llama", "8b-128k", "8GiB", None, seq=4096, effective=16),)
SETS = {"families": JOBS, "greedy": GREEDY}


def write_job(job: Job, assets: Path, run_dir: Path, tiny: bool, max_steps: int) -> Path:
    """The job file (resources by the device: a real card, or the CPU for the pipeline check)."""
    if tiny:
        resources = "{gpu: cpu}"
    else:
        host = "" if job.host_limit is None else f", host_memory_limit: {job.host_limit}"
        resources = f"{{gpu: cuda:0, gpu_memory_limit: {job.cap}{host}}}"
    text = f"""\
model: {{path: {assets / "model"}}}
data: {{path: {assets / "data.jsonl"}, text_field: text}}
lora: {{r: {job.r}, alpha: {2 * job.r}, target_modules: attention}}
train:
  max_seq_len: {job.seq if not tiny else 256}
  micro_batch_size: {job.micro}
  effective_batch_size: {job.effective}
  gradient_checkpointing: false
  optimizer: {job.optimizer}
  max_steps: {max_steps}
  save_steps: {max_steps}
  logging_steps: 1
resources: {resources}
supervise:
  {{max_attempts: 4, hang_timeout: 5m, backoff_initial: 1s, backoff_max: 5s, calibration_store: false}}
output_dir: {run_dir}
"""
    path = run_dir.parent / f"{job.name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def plan_of(job_file: Path, *flags: str) -> dict[str, Any]:
    """``qlora-supervise plan --json`` of a job (what the run will start from, and the host's numbers)."""
    done = subprocess.run(
        [*gpu_ladder.cli(), "plan", str(job_file), "--json", *flags],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-600:]}


def training_host_peak(events: list[dict[str, Any]]) -> int | None:
    """The child's RSS high-water mark in training: the heartbeats after the speed trial (or after the
    load, without one); the child restarted VmHWM at both."""
    marks = [i for i, e in enumerate(events) if e.get("event") in ("loaded", "speed_trial")]
    after = events[marks[-1] + 1 :] if marks else events
    peaks = [
        e["rss_high_water_bytes"]
        for e in after
        if e.get("event") == "heartbeat" and e.get("rss_high_water_bytes")
    ]
    return max(peaks) if peaks else None


def trial_rows(
    events: list[dict[str, Any]], shape: ModelShape, knobs: dict[str, Any], checkpoint: int
) -> list[dict[str, Any]]:
    """Each speed-trial candidate: its measured host peak against the host model's training peak."""
    trial = next((e for e in events if e.get("event") == "speed_trial"), None)
    rows = []
    for result in (trial or {}).get("results", []):
        c = result["candidate"]
        k = Knobs(**{**knobs, "micro_batch_size": c["micro_batch_size"], "grad_accum": c["grad_accum"],
                     "gradient_checkpointing": c["gradient_checkpointing"]})  # fmt: skip
        predicted = host_train_need(shape, k, checkpoint).train_peak
        rows.append({
            "candidate": f"b{c['micro_batch_size']}x{c['grad_accum']}"
            + (" gc" if c["gradient_checkpointing"] else ""),
            "tokens_per_s": result.get("tokens_per_s"),
            "host_peak_gib": _gib(result.get("host_peak_bytes")),
            "predicted_gib": _gib(predicted),
            "error": _error(predicted, result.get("host_peak_bytes")),
        })  # fmt: skip
    return rows


def summarise(job: Job, run_dir: Path, run: dict[str, Any], assets: Path) -> dict[str, Any]:
    """One job's row: start, attempts, host OOMs, quality, predicted against measured host peaks."""
    attempts = gpu_ladder.read_jsonl(run_dir / "attempts.jsonl")
    first, last = (attempts[0], attempts[-1]) if attempts else ({}, {})
    knobs = last.get("knobs") or {}
    written = {"max_seq_len": job.seq, "lora_r": job.r}
    events = gpu_ladder.read_jsonl(run_dir / f"attempt-{len(attempts):03d}" / "child-events.jsonl")
    config = json.loads((assets / "model" / "config.json").read_text())
    shape = ModelShape.from_config(config)
    checkpoint = shape.params * 2
    predicted = host_train_need(shape, Knobs(**knobs), checkpoint) if knobs else None
    measured = training_host_peak(events)
    loaded = next((e for e in events if e.get("event") == "loaded"), {})
    kinds = [(a.get("failure") or {}).get("kind") for a in attempts]
    beats = [e for e in events if e.get("event") == "heartbeat" and e.get("tokens_per_s")]
    return {
        "job": job.name,
        "family": job.family,
        "cap": job.cap,
        "host_limit": job.host_limit,
        "exit_code": run["exit_code"],
        "wall_s": run["wall_s"],
        "attempts": len(attempts),
        "host_ooms": kinds.count("host_oom"),
        "ooms": sum(1 for k in kinds if k and (k.startswith("oom_") or k == "host_oom")),
        "start": _knobs_text(first.get("knobs") or {}),
        "offload": bool(knobs.get("activation_offload")),
        "quality_changed": [k for k in QUALITY if k in written and knobs.get(k) != written[k]],
        "steps": last.get("steps_completed"),
        "predicted_train_gib": _gib(predicted.train_peak if predicted else None),
        "measured_train_gib": _gib(measured),
        "train_error": _error(predicted.train_peak if predicted else None, measured),
        "predicted_components": dict(predicted.train_components) if predicted else {},
        "predicted_load_gib": _gib(predicted.load_peak if predicted else None),
        "measured_load_gib": _gib(loaded.get("rss_high_water_bytes")),
        "load_error": _error(predicted.load_peak if predicted else None, loaded.get("rss_high_water_bytes")),
        "journal_host": last.get("host"),
        "trial": trial_rows(events, shape, knobs, checkpoint) if knobs else [],
        "tokens_per_s": beats[-1]["tokens_per_s"] if beats else None,
    }


def _knobs_text(k: dict[str, Any]) -> str:
    if not k:
        return "-"
    parts = [f"s{k.get('max_seq_len')}", f"b{k.get('micro_batch_size')}x{k.get('grad_accum')}"]
    parts += [name for name, key in (("gc", "gradient_checkpointing"), ("offload", "activation_offload"),
                                      ("bf16head", "bf16_head")) if k.get(key)]  # fmt: skip
    return " ".join(parts)


def _gib(value: int | None) -> float | None:
    return None if value is None else round(value / GiB, 2)


def _error(predicted: int | None, measured: int | None) -> float | None:
    return None if not predicted or not measured else round(predicted / measured - 1, 4)


class UsedRam:
    """The machine's used RAM, sampled every second while the jobs run; its highest."""

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            memory = psutil.virtual_memory()
            self.peak = max(self.peak, int(memory.total - memory.available))

    def __enter__(self) -> UsedRam:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def table(rows: list[dict[str, Any]], machine: dict[str, Any]) -> list[str]:
    head = ("job", "exit", "att", "host_oom", "quality", "start", "host limit", "train pred", "train meas",
            "err", "load pred", "load meas", "err", "tok/s")  # fmt: skip
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for r in rows:
        quality = ",".join(r["quality_changed"]) or "none"
        cells = (r["job"], r["exit_code"], r["attempts"], r["host_ooms"], quality, r["start"],
                 r["host_limit"], r["predicted_train_gib"], r["measured_train_gib"], _pct(r["train_error"]),
                 r["predicted_load_gib"], r["measured_load_gib"], _pct(r["load_error"]),
                 r["tokens_per_s"])  # fmt: skip
        lines.append(" | ".join(str(c) for c in cells))
    lines.append("")
    for r in rows:
        for t in r["trial"]:
            lines.append(
                f"trial {r['job']}: {t['candidate']} {t['tokens_per_s']} tok/s, "
                f"host {t['host_peak_gib']} GiB "
                f"(predicted {t['predicted_gib']}, {_pct(t['error'])})"
            )
    lines.append(
        f"machine: {machine['total_gib']} GiB RAM, host limits sum {machine['limits_gib']} GiB, used at most "
        f"{machine['used_peak_gib']} GiB while the jobs ran (from {machine['used_before_gib']} GiB)"
    )
    within = [r for r in rows if r["train_error"] is not None and abs(r["train_error"]) <= TOLERANCE]
    lines.append(
        f"{len(rows)} jobs: {sum(r['host_ooms'] for r in rows)} host OOM, "
        f"attempts {[r['attempts'] for r in rows]}, "
        f"quality changes {sum(1 for r in rows if r['quality_changed'])}, training host peak within "
        f"{TOLERANCE:.0%}: {len(within)}/{len(rows)}"
    )
    return lines


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.1%}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/memory_grid"))
    p.add_argument("--deadline-s", type=float, default=420.0)
    p.add_argument("--max-steps", type=int, default=4)
    p.add_argument("--tiny", action="store_true", help="tiny models on the CPU: the pipeline only")
    p.add_argument("--only", nargs="+", metavar="FAMILY", help="these families' jobs alone")
    p.add_argument("--set", choices=tuple(SETS), default="families")
    p.add_argument("--load-split", metavar="SHAPE", help="measure the load's RSS by kind for this shape")
    args = p.parse_args(argv)
    if args.load_split:
        memory_grid.build_all([args.load_split], args.work, False, 4096)
        split = load_split(str(args.work / args.load_split / "model"))
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"load-split-{args.load_split}.json").write_text(json.dumps(split, indent=2) + "\n")
        print(json.dumps(split))
        return 0
    start = time.monotonic()
    jobs = tuple(j for j in SETS[args.set] if not args.only or j.family in args.only)
    shapes = sorted({j.shape for j in jobs})
    print(
        "build:",
        memory_grid.build_all(shapes, args.work, args.tiny, 4096 if not args.tiny else 512),
        flush=True,
    )
    args.out.mkdir(parents=True, exist_ok=True)
    runs = args.work / "host-memory-runs"
    files = {}
    for job in jobs:
        run_dir = runs / job.name / "run"
        shutil.rmtree(run_dir, ignore_errors=True)
        files[job.name] = write_job(job, args.work / job.shape, run_dir, args.tiny, args.max_steps)
    plans = {name: plan_of(path) for name, path in files.items()}
    before = psutil.virtual_memory()

    def one(job: Job) -> dict[str, Any]:
        run_dir = runs / job.name / "run"
        left = args.deadline_s - (time.monotonic() - start)
        run = gpu_ladder.run_supervised(files[job.name], runs / job.name / "supervisor.log", left)
        row = summarise(job, run_dir, run, args.work / job.shape)
        row["plan_start"] = (plans[job.name].get("start") or {}).get("reasons")
        row["plan_host"] = plans[job.name].get("host")
        print(
            "  done",
            json.dumps({k: v for k, v in row.items() if k not in ("plan_start", "plan_host")}),
            flush=True,
        )
        return row

    with UsedRam() as used, ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        rows = list(pool.map(one, jobs))
    machine = {
        "total_gib": _gib(before.total),
        "used_before_gib": _gib(before.total - before.available),
        "used_peak_gib": _gib(used.peak),
        "limits_gib": sum(int(j.host_limit.removesuffix("GiB")) for j in jobs if j.host_limit),
    }
    user = _eight_gb_user(args.work, runs) if args.set == "families" else {}
    (args.out / "results.json").write_text(
        json.dumps({"jobs": rows, "machine": machine, "eight_gb_user": user}, indent=2), encoding="utf-8"
    )
    lines = table(rows, machine)
    if user:
        lines.append(f"8 GB-card user (Llama-3-8B, seq 2048): {user.get('summary')}")
    (args.out / "table.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    print(f"total {time.monotonic() - start:.0f} s")
    return 0


def load_split(model: str) -> dict[str, Any]:
    """The recipe's 4-bit load of ``model`` on this card, sampling /proc/self/status from a thread:
    the peaks of RssAnon, RssFile and VmHWM, in GiB (runs in its own process: fresh counters)."""
    import torch

    from qlora_supervise.trainer_child.contract.spec import TrainSpec
    from qlora_supervise.trainer_child.recipe.qlora import load_model

    peaks = {"RssAnon": 0, "RssFile": 0, "VmHWM": 0}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            with open("/proc/self/status", encoding="ascii") as handle:
                for line in handle:
                    key = line.split(":")[0]
                    if key in peaks:
                        peaks[key] = max(peaks[key], int(line.split()[1]) * 1024)

    knobs = Knobs(model=model, bf16_head=True)
    # What load_model reads of an attempt's spec: the knobs, trust_remote_code, the GPU cap.
    spec: Any = SimpleNamespace(knobs=knobs, train=TrainSpec(), gpu_memory_limit=None)
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    began = time.monotonic()
    load_model(spec, torch.bfloat16, on_cuda=True)
    seconds = time.monotonic() - began
    done.set()
    thread.join()
    return {**{k: _gib(v) for k, v in peaks.items()}, "load_s": round(seconds, 1)}


def _eight_gb_user(work: Path, runs: Path) -> dict[str, Any]:
    """The plan for the seeds' user: Llama-3-8B, seq 2048, micro-batch 1, checkpointing, an 8 GiB card,
    at several host sizes: which start it (the random-weight model is cut in 5 GB shards, as the
    released one is)."""
    assets = work / "8b-128k"
    if not (assets / "model" / "config.json").is_file():
        return {"summary": "8b-128k not built"}
    path = runs / "user-8b.yaml"
    path.write_text(
        f"model: {{path: {assets / 'model'}}}\ndata: {{path: {assets / 'data.jsonl'}, text_field: text}}\n"
        "train: {max_seq_len: 2048, micro_batch_size: 1, effective_batch_size: 16,"
        " gradient_checkpointing: true}\n"
        f"output_dir: {runs / 'user-8b-run'}\n",
        encoding="utf-8",
    )
    out: dict[str, Any] = {}
    for host in ("4GiB", "7GiB", "8GiB", "16GiB", "24GiB"):
        plan = plan_of(path, "--gpu-memory", "8GiB", "--host-memory", host)
        start = plan.get("start") or {}
        out[host] = {
            "fits": start.get("fits"),
            "nothing_fits_host": bool((start.get("nothing_fits") or {}).get("host")),
            "start": start.get("changes"),
            "host_peak_gib": _gib((plan.get("host") or {}).get("train_peak_bytes")),
            "train_phase_gib": _gib((plan.get("host") or {}).get("train_phase_bytes")),
        }
    fits = [h for h in out if out[h]["fits"]]
    need, train = out["24GiB"]["host_peak_gib"], out["24GiB"]["train_phase_gib"]
    out["summary"] = (
        f"host need {need} GiB (training itself {train} GiB); "
        f"plan starts with --host-memory {', '.join(fits) or 'none'}"
    )
    return out


if __name__ == "__main__":
    raise SystemExit(main())
