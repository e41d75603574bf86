"""Two cards through torchrun: issue 35's acceptance, awaiting a machine with two H200s.

    python -m bench.scenarios.two_gpus --out OUT [--set ddp_oom rank_killed fsdp_70b]
    python -m bench.scenarios.two_gpus --out OUT --tiny     # CPU smoke: two gloo ranks, the tiny model

Each scenario is a real ``qlora-supervise run`` of a job with ``resources.nproc_per_node: 2``:

* ``ddp_oom``: a Llama-2-7B-shaped DDP job, each card capped (``--cap``); after step ``--oom-after``
  rank 1's cap drops to ``--rank1-cap`` (injected: ``QLORA_SUPERVISE_TEST_RANK_GPU_CAP`` with
  ``QLORA_SUPERVISE_TEST_CAP_AFTER_STEP``), a real CUDA OOM on one card mid-run. Passes when the
  failure names rank 1 (and, from NVML, its card), both ranks' ``resumed`` events of the next
  attempt show one new config, the journal counts 0 lost steps (no regular checkpoint falls on the
  failed step: the ranks' emergency parts serve) and the run finishes.
* ``rank_killed``: the same job with no cap fault; the bench SIGKILLs rank 1 after step
  ``--kill-after``, then in each later attempt as soon as it has loaded (a card that keeps dying).
  Passes when ``drop_rank`` leaves card 1 out and the run finishes on one card, effective batch kept.
* ``fsdp_70b``: 70B-shaped blocks (hidden 8192, intermediate 28672, 64/8 heads, vocab 128256;
  ``--layers`` of them, 80 for the whole 70B where the disk holds its 140 GB of bf16) under
  ``resources.parallel: fsdp`` at seq 4096, micro-batch 4, each card capped 10 % above FSDP's
  floor per rank (its load: the whole 4-bit model and the 16-bit head). Passes when ``plan`` finds
  no config for one card at that cap, the run trains on two, and each rank's allocator peak is
  within 5 % of the plan's.

``--tiny`` runs ``ddp_oom`` and ``rank_killed`` with gloo ranks on the CPU (rank 1's CPU cap in place
of the GPU cap) and ``fsdp_70b`` as the plan of a config.json-only model (FSDP needs GPUs): a smoke
test of this script, whose numbers mean nothing. Writes ``OUT/results.json`` and ``OUT/table.txt``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from qlora_supervise.policies.memory.gpu import training_phases
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.trainer_child.contract.spec import Knobs

from .._launch import module_argv
from .gpu_ladder import LLAMA2_7B, TINY, build_assets, cli, read_jsonl

GiB = 1 << 30
LLAMA_70B_BLOCKS = {
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "max_position_embeddings": 4096,
    "vocab_size": 128256,
}
RANK_GPU_CAP, RANK_CPU_CAP = "QLORA_SUPERVISE_TEST_RANK_GPU_CAP", "QLORA_SUPERVISE_TEST_RANK_CPU_CAP"
CAP_AFTER_STEP = "QLORA_SUPERVISE_TEST_CAP_AFTER_STEP"
#: The FSDP job's training (tests/test_fsdp_plan.py's): long sequences, so training needs the cards.
LONG = {"max_seq_len": 4096, "micro_batch_size": 4, "gradient_checkpointing": False}


def write_job(
    path: Path, model: Path, data: Path, run_dir: Path, args: argparse.Namespace, **over: Any
) -> Path:
    train = {
        "max_seq_len": args.seq, "micro_batch_size": args.micro, "effective_batch_size": args.effective,
        "gradient_checkpointing": False, "max_steps": args.max_steps, "save_steps": args.save_steps,
        "logging_steps": 1, "warmup_ratio": 0.0,
    }  # fmt: skip
    resources: dict[str, Any] = {"gpu": "cpu" if args.tiny else "auto", "nproc_per_node": 2}
    if not args.tiny:
        resources["gpu_memory_limit"] = args.cap
    job = {
        "model": {"path": str(model)},
        "data": {"path": str(data)},
        "lora": {"r": 8, "alpha": 16, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "train": {**train, **over.pop("train", {})},
        "resources": {**resources, **over.pop("resources", {})},
        "supervise": {
            "hang_timeout": "5m",
            "backoff_initial": "1s",
            "backoff_max": "5s",
            **over.pop("supervise", {}),
        },
        "output_dir": str(run_dir),
    }
    path.write_text(yaml.safe_dump(job, sort_keys=False), encoding="utf-8")
    return path


def run(job: Path, log: Path, env: dict[str, str], timeout: float, watch: Any = None) -> dict[str, Any]:
    """``qlora-supervise run job --plain`` with a wall-clock limit and an optional watcher thread."""
    started, stop = time.monotonic(), threading.Event()
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            [*cli(), "run", str(job), "--plain"], stdout=out, stderr=subprocess.STDOUT,
            env={**os.environ, **env}, start_new_session=True,
        )  # fmt: skip
        thread = threading.Thread(target=watch, args=(stop,), daemon=True) if watch else None
        if thread:
            thread.start()
        try:
            code: int | None = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            code = proc.wait(timeout=60)
        stop.set()
    return {"exit": code, "wall_s": round(time.monotonic() - started, 1)}


def events_of(path: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(path) if e.get("event") == name]


def rank1_killer(run_dir: Path, kill_after: int, kills: list[dict[str, Any]]) -> Any:
    """SIGKILL rank 1: in attempt 1 after step ``kill_after``, in later two-rank attempts once loaded."""

    def watch(stop: threading.Event) -> None:
        done: set[int] = set()
        while not stop.wait(0.2):
            attempts = sorted(run_dir.glob("attempt-*"))
            if not attempts or attempts[-1].name in done:
                continue
            attempt, events = attempts[-1], attempts[-1] / "child-events.rank1.jsonl"
            started = events_of(events, "started")
            first = attempt.name == "attempt-001"
            steps = [e.get("step") or 0 for e in events_of(events, "heartbeat")]
            due = max(steps, default=0) >= kill_after if first else bool(events_of(events, "trainer_ready"))
            if started and due:
                with_pid = started[-1]["pid"]
                try:
                    os.kill(with_pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
                kills.append({"attempt": attempt.name, "pid": with_pid, "step": max(steps, default=0)})
                done.add(attempt.name)

    return watch


def plan_json(job: Path) -> dict[str, Any]:
    done = subprocess.run([*cli(), "plan", str(job), "--json"], capture_output=True, text=True, timeout=300)
    try:  # nothing fitting is an exit code of its own, with the same JSON
        return dict(json.loads(done.stdout))
    except ValueError:
        return {"error": done.stderr[-2000:]}


# --------------------------------------------------------------------------- the scenarios


def ddp_oom(args: argparse.Namespace, assets: dict[str, Any], out: Path) -> dict[str, Any]:
    run_dir = args.work / "run-ddp-oom"
    over: dict[str, Any] = {}
    if args.tiny:  # the CPU cap hook, as tests/test_torchrun_real.py: micro-batch 8 overruns it
        over = {
            "supervise": {
                "ladders": {"oom_forward": ["halve_micro_batch"], "oom_backward": ["halve_micro_batch"]}
            }
        }
    job = write_job(args.work / "job-ddp-oom.yaml", assets["model"], assets["data"], run_dir, args, **over)
    fault = {
        RANK_CPU_CAP if args.tiny else RANK_GPU_CAP: f"1:{args.rank1_cap}",
        CAP_AFTER_STEP: str(args.oom_after),
    }
    result = run(job, out / "ddp_oom.log", fault, args.scenario_s)
    attempts = read_jsonl(run_dir / "attempts.jsonl")
    first = attempts[0] if attempts else {}
    failure, second = first.get("failure") or {}, run_dir / "attempt-002"
    resumed = [events_of(second / n, "resumed") for n in ("child-events.jsonl", "child-events.rank1.jsonl")]
    configs = {
        json.dumps({k: e[-1].get(k) for k in ("from_step", "micro_batch_size", "grad_accum")})
        for e in resumed
        if e
    }
    checks = {
        "rank 1 named": failure.get("rank") == 1,
        "its card named": failure.get("gpu") is not None or args.tiny,
        "both ranks resumed with one config": len(configs) == 1 and all(resumed),
        "0 steps lost": bool(attempts) and sum(a.get("lost_steps", 0) for a in attempts) == 0,
        "finished": result["exit"] == 0,
    }
    return {
        **result,
        "checks": checks,
        "failure": failure,
        "configs": sorted(configs),
        "attempts": len(attempts),
    }


def rank_killed(args: argparse.Namespace, assets: dict[str, Any], out: Path) -> dict[str, Any]:
    run_dir = args.work / "run-rank-killed"
    over = {"supervise": {"max_no_progress_attempts": 2}}
    job = write_job(
        args.work / "job-rank-killed.yaml", assets["model"], assets["data"], run_dir, args, **over
    )
    kills: list[dict[str, Any]] = []
    result = run(
        job, out / "rank_killed.log", {}, args.scenario_s, rank1_killer(run_dir, args.kill_after, kills)
    )
    attempts = read_jsonl(run_dir / "attempts.jsonl")
    drops = [a for a in attempts if (a.get("decision") or {}).get("rung") == "drop_rank"]
    last = attempts[-1] if attempts else {}
    knobs = last.get("knobs") or {}
    checks = {
        "rank 1 killed": bool(kills),
        "drop_rank left card 1 out": bool(drops)
        and (drops[0]["decision"].get("knobs") or {}).get("gpus", "") in ("", "0"),
        "finished on one card": result["exit"] == 0 and knobs.get("world_size") == 1,
        "effective batch kept": knobs.get("micro_batch_size", 0)
        * knobs.get("grad_accum", 0)
        * knobs.get("world_size", 0)
        == args.effective,
    }
    return {**result, "checks": checks, "kills": kills, "attempts": len(attempts)}


def fsdp_70b(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    shape = {**LLAMA_70B_BLOCKS, "num_hidden_layers": args.layers}
    work = args.work / f"fsdp-{args.layers}"
    if args.tiny:  # the plan of a config.json-only model: FSDP training needs GPUs
        (work / "model").mkdir(parents=True, exist_ok=True)
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "tie_word_embeddings": False,
            **shape,
        }
        (work / "model" / "config.json").write_text(json.dumps(config))
        (work / "data.jsonl").write_text('{"text": "one two three"}\n')
        assets = {"model": work / "model", "data": work / "data.jsonl"}
        host = {"host_memory_limit": "1TiB"}  # the GPU host's RAM, not this machine's, is the question
    else:
        assets, host = build(args, work, shape), {}
    run_dir = args.work / "run-fsdp"
    cap = fsdp_cap(json.loads((assets["model"] / "config.json").read_text()))
    fsdp = {"resources": {"gpu": "auto", "parallel": "fsdp", "gpu_memory_limit": cap, **host}, "train": LONG}
    job = write_job(work / "job-fsdp.yaml", assets["model"], assets["data"], run_dir, args, **fsdp)
    ddp = {
        "resources": {"gpu": "auto", "gpu_memory_limit": cap, **host},
        "train": LONG,
    }
    one_card = plan_json(write_job(work / "ddp.yaml", assets["model"], assets["data"], run_dir, args, **ddp))
    planned = plan_json(job)
    result: dict[str, Any] = {
        "cap": cap,
        "planned_peak_bytes": (planned.get("start") or {}).get("peak_bytes"),
    }
    checks = {
        "no single card fits": not (one_card.get("start") or {}).get("fits", True),
        "fits on two under FSDP": bool((planned.get("start") or {}).get("fits")),
    }
    if not args.tiny:
        result.update(run(job, out / "fsdp_70b.log", {}, args.scenario_s))
        exits = events_of(run_dir / "events.jsonl", "child_exited")
        peaks = {int(r): int(b) for r, b in ((exits[-1].get("rank_peaks") or {}) if exits else {}).items()}
        plan_peak = result["planned_peak_bytes"] or 1
        result["rank_peaks"] = peaks
        checks["trained on two"] = result["exit"] == 0 and len(peaks) == 2
        checks["per-rank peaks within 5 % of the plan"] = bool(peaks) and all(
            abs(p / plan_peak - 1) <= 0.05 for p in peaks.values()
        )
    return {**result, "checks": checks}


def fsdp_cap(config: dict[str, Any]) -> str:
    """Each card's cap: 10 % above FSDP's floor on it, its load (the whole 4-bit model and the 16-bit
    head), in 0.5 GiB steps; one card then has no room for training beside the same weights."""
    knobs = Knobs(model="m", world_size=2, fsdp=True, lora_r=8)
    load = sum(training_phases(ModelShape.from_config(config), knobs, "attention", 2)["load"].values())
    return f"{math.ceil(load * 1.10 / GiB * 2) / 2}GiB"


def build(args: argparse.Namespace, work: Path, shape: dict[str, int]) -> dict[str, Any]:
    """Random-weight model, tokenizer and data (gpu_ladder's builder) in a child process, once."""
    if not (work / "model" / "config.json").is_file():
        argv = [
            *module_argv(__spec__),
            "--_build",
            str(work),
            "--out",
            str(work),
            *(["--tiny"] if args.tiny else []),
        ]
        subprocess.run([*argv, "--_shape", json.dumps(shape), "--seq", str(args.seq)], check=True)
    return {"model": work / "model", "data": work / "data.jsonl"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/two_gpus"), help="models, data, runs (large)")
    p.add_argument("--set", nargs="+", default=["ddp_oom", "rank_killed", "fsdp_70b"])
    p.add_argument("--tiny", action="store_true", help="CPU smoke: gloo ranks, the tiny model")
    p.add_argument("--cap", default="24GiB", help="each card's gpu_memory_limit (DDP scenarios)")
    p.add_argument("--rank1-cap", default=None, help="rank 1's cap after --oom-after (bytes)")
    p.add_argument("--oom-after", type=int, default=None, help="a step no regular checkpoint falls on")
    p.add_argument("--kill-after", type=int, default=2)
    p.add_argument("--layers", type=int, default=None, help="70B-shaped blocks (default 20; --tiny 80)")
    p.add_argument("--seq", type=int, default=None)
    p.add_argument("--micro", type=int, default=None)
    p.add_argument("--effective", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--save-steps", type=int, default=None)
    p.add_argument("--scenario-s", type=float, default=540.0, help="wall-clock limit of each run")
    p.add_argument("--_build", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--_shape", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    # The tiny defaults are tests/test_torchrun_real.py's: micro-batch 8 at seq 256 overruns 860 MiB.
    for name, gpu, tiny in (
        ("seq", 1024, 256),
        ("micro", 4, 8),
        ("max_steps", 8, 4),
        ("save_steps", 5, 3),
        ("oom_after", 3, 2),
        ("layers", 20, 80),
    ):
        if getattr(args, name) is None:
            setattr(args, name, tiny if args.tiny else gpu)
    args.rank1_cap = args.rank1_cap or str((860 << 20) if args.tiny else 10 * GiB)
    if args._build:
        shape = json.loads(args._shape) if args._shape else (TINY if args.tiny else LLAMA2_7B)
        print(json.dumps(build_assets(args._build, shape, "cpu" if args.tiny else "cuda", 64, args.seq)))
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    assets = (
        build(args, args.work / "ddp", TINY if args.tiny else LLAMA2_7B)
        if set(args.set) - {"fsdp_70b"}
        else {}
    )
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}}
    for name in args.set:
        print(f"running {name} ...", flush=True)
        results[name] = (
            fsdp_70b(args, args.out) if name == "fsdp_70b" else globals()[name](args, assets, args.out)
        )
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")
    lines = [f"{'scenario':<12} {'check':<42} ok"]
    lines += [
        f"{n:<12} {c:<42} {'yes' if v else 'NO'}" for n in args.set for c, v in results[n]["checks"].items()
    ]
    (args.out / "table.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines))
    return 0 if all(all(results[n]["checks"].values()) for n in args.set) else 1


if __name__ == "__main__":
    sys.exit(main())
