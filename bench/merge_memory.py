"""The low-memory merge on a Llama-2-7B shape: time, GPU peak and host peak, per device.

    python bench/merge_memory.py --out OUT [--devices cuda cpu] [--deadline-s 540]
    python bench/merge_memory.py --out /tmp/m --tiny --devices cpu     # the same logic on the CPU

1. once: the random-weight Llama-2-7B-shaped model of ``bench/gpu_ladder.py`` (bf16,
   safetensors; built in a subprocess) and a LoRA adapter on q/k/v/o with r 8 and random
   non-zero B matrices (peft starts B at zero, which would make the merge a no-op);
2. per device: the merge child (``python -m qlora_supervise.trainer_child.merge.process``, the same one
   ``run`` starts for ``train.merge: true``) with ``QLORA_SUPERVISE_MERGE_DEVICE`` set, its RSS
   sampled from outside every 0.2 s; its own ``merged/merge.json`` gives the plan, the CUDA
   allocator's peak and its VmHWM.

Writes ``OUT/results.json`` and ``OUT/table.txt``; prints the table. Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

HERE = Path(__file__).resolve().parent
DEVICE_ENV = "QLORA_SUPERVISE_MERGE_DEVICE"


def make_adapter(model: Path, out: Path) -> dict[str, Any]:
    """A trained-looking adapter (random B) saved with the tokenizer, as training saves it."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16, low_cpu_mem_usage=True)
    peft_model = get_peft_model(
        base, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    )
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.01)
    peft_model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model).save_pretrained(out)
    return {"adapter_bytes": sum(p.stat().st_size for p in out.glob("*.safetensors"))}


def write_spec(work: Path, run: Path, model: Path) -> Path:
    from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DataSpec, Knobs, TrainSpec

    spec = AttemptSpec(
        attempt=1,
        run_dir=str(run),
        knobs=Knobs(model=str(model)),
        data=DataSpec(path=str(work / "data.jsonl")),
        train=TrainSpec(compute_dtype="bf16"),
        events_file=str(run / "merge" / "child-events.jsonl"),
        error_file=str(run / "merge" / "error.json"),
        checkpoints_dir=str(run / "checkpoints"),
        adapter_dir=str(work / "adapter"),
        merged_dir=str(run / "merged"),
        device="cuda:0",
    )
    path = run / "merge" / "spec.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(spec.to_json(), encoding="utf-8")
    return path


def merge_once(work: Path, device: str, timeout: float) -> dict[str, Any]:
    """One merge child on ``device``; wall time, outside RSS peak, and the child's merge.json."""
    run = work / f"run-{device}"
    shutil.rmtree(run, ignore_errors=True)
    spec = write_spec(work, run, work / "model")
    env = {**os.environ, DEVICE_ENV: device, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "qlora_supervise.trainer_child.merge.process", "--spec", str(spec)]
    t0 = time.monotonic()
    with (run / "merge" / "child.log").open("wb") as log:
        child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
        rss_peak = 0
        while child.poll() is None and time.monotonic() - t0 < timeout:
            with contextlib.suppress(psutil.Error):  # the child may exit between poll and read
                rss_peak = max(rss_peak, psutil.Process(child.pid).memory_info().rss)
            time.sleep(0.2)
        if child.poll() is None:
            child.kill()
        code = child.wait()
    result: dict[str, Any] = {"device": device, "exit": code, "wall_s": round(time.monotonic() - t0, 1)}
    result["rss_peak_sampled_bytes"] = rss_peak
    report = run / "merged" / "merge.json"
    if report.is_file():
        result["report"] = json.loads(report.read_text())
        result["merged_bytes"] = sum(p.stat().st_size for p in (run / "merged").glob("*.safetensors"))
    else:
        result["log_tail"] = (run / "merge" / "child.log").read_text(errors="replace")[-3000:]
    shutil.rmtree(run / "merged", ignore_errors=True)  # 13.5 GB per device: keep the disk free
    return result


def gib(value: Any) -> str:
    return f"{value / 2**30:.2f} GiB" if isinstance(value, int | float) and value else "-"


def table(results: dict[str, Any]) -> list[str]:
    lines = [
        "device  exit  wall     GPU peak (allocator)  host peak (VmHWM)  host peak (sampled)  chosen by plan"
    ]
    for r in results["merges"]:
        rep = r.get("report", {})
        lines.append(
            f"{r['device']:<6}  {r['exit']:<4}  {r['wall_s']:>6.1f}s  {gib(rep.get('gpu_peak_bytes')):>20}  "
            f"{gib(rep.get('host_peak_bytes')):>17}  {gib(r['rss_peak_sampled_bytes']):>19}  "
            f"{rep.get('plan', {}).get('why', '-')}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/merge_memory"))
    p.add_argument("--devices", nargs="+", default=["cuda", "cpu"], choices=("auto", "cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="the tiny shape, on the CPU (checks the script)")
    p.add_argument("--deadline-s", type=float, default=540.0)
    p.add_argument("--_adapter", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._adapter:
        print("ADAPTER " + json.dumps(make_adapter(args.work / "model", args.work / "adapter")), flush=True)
        return 0
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "merges": []}
    if not (args.work / "model" / "config.json").is_file():
        build = [
            sys.executable,
            str(HERE / "gpu_ladder.py"),
            "--_build",
            "--work",
            str(args.work),
            "--rows",
            "8",
            "--seq",
            "64",
            "--out",
            str(args.out),
            *(["--tiny"] if args.tiny else []),
        ]
        done = subprocess.run(build, capture_output=True, text=True)
        results["build"] = {"exit": done.returncode, "tail": (done.stdout + done.stderr)[-1500:]}
        if done.returncode != 0:
            (args.out / "results.json").write_text(json.dumps(results, indent=1))
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
    if not (args.work / "adapter" / "adapter_config.json").is_file():
        done = subprocess.run(
            [sys.executable, __file__, "--_adapter", "--work", str(args.work), "--out", str(args.out)],
            capture_output=True,
            text=True,
        )
        results["adapter"] = done.stdout[-500:] or done.stderr[-3000:]
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
            return 1
    for device in args.devices:
        left = args.deadline_s - (time.monotonic() - start)
        if left < 30:
            results["merges"].append(
                {"device": device, "exit": "skipped", "wall_s": 0.0, "rss_peak_sampled_bytes": 0}
            )
            continue
        print(f"merging on {device} (limit {left - 10:.0f} s) ...", flush=True)
        results["merges"].append(merge_once(args.work, device, left - 10))
        (args.out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    lines = table(results)
    (args.out / "table.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
