"""The supervisor's OOM ladder on a real GPU: a Llama-2-7B-shaped QLoRA job on an emulated small card.

    python -m bench.scenarios.gpu_ladder --out OUT [--caps 8GiB 16GiB] [--deadline-s 540]
    python -m bench.scenarios.gpu_ladder --out /tmp/b --tiny          # the same logic on the CPU, tiny model

What it does, per scenario (one ``gpu_memory_limit`` cap each):

1. once: builds a randomly initialised Llama-2-7B-shaped model (hidden 4096, 32 layers,
   32 heads, intermediate 11008, vocab 32000) on the GPU in bf16 and ``save_pretrained``s it,
   with a word-level tokenizer trained locally (no download) and a jsonl dataset whose rows are
   all longer than 2048 tokens; this runs in a subprocess, so this process never holds GPU memory;
2. writes a job.yaml (seq 2048, micro-batch 4, effective batch 16, no gradient checkpointing,
   paged_adamw_8bit, r 8 on q/k/v/o, ``gpu_memory_limit`` = the cap) and runs
   ``qlora-supervise run job.yaml --plain`` with a wall-clock limit (SIGTERM, then SIGKILL),
   so a slow scenario still leaves partial results;
3. reads back attempts.jsonl and events.jsonl and runs ``qlora-supervise classify
   attempt-NNN/child.log --json`` on every failed attempt's log (does the text-only classifier
   agree with the error-report classification on real GPU output?).

Writes ``OUT/results.json``, ``OUT/table.txt`` and, per scenario, ``OUT/<name>/`` with
attempts.jsonl, events.jsonl, supervisor.log and the child.log tails of failed attempts.
Prints the table last. Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .._launch import module_argv

LLAMA2_7B = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "max_position_embeddings": 4096,
    "vocab_size": 32000,
}
TINY = {
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 4096,
    "vocab_size": 1024,
}
SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>"]
GiB = 1 << 30


# --------------------------------------------------------------------------- building


def spell(number: int) -> str:
    return " ".join(str(number))


def long_rows(count: int, min_tokens: int, seed: int = 0) -> list[dict[str, str]]:
    """Counting exercises, each longer than ``min_tokens`` whitespace tokens (= word-level tokens)."""
    rng = random.Random(seed)
    rows = []
    for index in range(count):
        stride, start = rng.randint(1, 3), rng.randint(100, 900)
        words = f"row {spell(index)} count by {stride} from {spell(start)} :".split()
        k = 0
        while len(words) < min_tokens + 64:
            words += [*spell(start + stride * k).split(), ","]
            k += 1
        rows.append({"text": " ".join(words)})
    return rows


def build_assets(
    work: Path, shape: dict[str, int], device: str, rows: int, min_tokens: int
) -> dict[str, Any]:
    """Model (random weights, bf16), tokenizer and dataset under ``work``; runs in a child process."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    t0 = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    data = long_rows(rows, min_tokens)
    with (work / "data.jsonl").open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in data)
    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.train_from_iterator(
        [r["text"] for r in data], trainer=trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS)
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        model_max_length=shape["max_position_embeddings"],
    )
    assert len(tokenizer) <= shape["vocab_size"], (len(tokenizer), shape["vocab_size"])
    lengths = [len(tokenizer(r["text"])["input_ids"]) for r in data[:8]]
    torch.manual_seed(0)
    config = LlamaConfig(pad_token_id=0, bos_token_id=2, eos_token_id=3, tie_word_embeddings=False, **shape)
    t_build = time.monotonic()
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    del model
    return {
        "params": params,
        "tokens_per_row_min": min(lengths),
        "vocab_used": len(tokenizer),
        "build_s": round(time.monotonic() - t_build, 1),
        "total_s": round(time.monotonic() - t0, 1),
        "model_dir": str(work / "model"),
        "data": str(work / "data.jsonl"),
    }


def write_job(path: Path, work: Path, run_dir: Path, args: argparse.Namespace, cap: str) -> Path:
    if args.tiny:
        resources = f"{{gpu: cpu, cpu_memory_limit: {cap}}}"
    else:
        resources = f"{{gpu: {args.gpu}, gpu_memory_limit: {cap}}}"
    path.write_text(
        f"""\
model: {{path: {work / "model"}, fallbacks: [], trust_remote_code: false}}
data: {{path: {work / "data.jsonl"}, text_field: text, eval_fraction: 0.0}}
quantization: {{load_in_4bit: true, quant_type: nf4, double_quant: true, compute_dtype: auto}}
lora: {{r: 8, alpha: 16, dropout: 0.05, target_modules: [q_proj, k_proj, v_proj, o_proj]}}
train:
  max_seq_len: {args.seq}
  micro_batch_size: {args.micro}
  effective_batch_size: {args.effective}
  gradient_checkpointing: false
  optimizer: paged_adamw_8bit
  learning_rate: 2.0e-4
  lr_scheduler: cosine
  warmup_ratio: 0.03
  max_grad_norm: 0.3
  max_steps: {args.max_steps}
  save_steps: {args.save_steps}
  logging_steps: 1
  merge: false
resources: {resources}
supervise:
  max_attempts: 8
  hang_timeout: 5m
  backoff_initial: 1s
  backoff_max: 5s
  warm_spare: {args.warm_spare}
output_dir: {run_dir}
""",
        encoding="utf-8",
    )
    return path


# --------------------------------------------------------------------------- running


def cli() -> list[str]:
    exe = shutil.which("qlora-supervise")
    return [exe] if exe else [sys.executable, "-m", "qlora_supervise.supervisor.commands.cli"]


def run_supervised(job: Path, log: Path, timeout: float, *extra: str) -> dict[str, Any]:
    """``qlora-supervise run job --plain [extra]`` with a wall-clock limit; SIGTERM (the child
    checkpoints), then kill."""
    t0 = time.monotonic()
    timed_out = False
    with log.open("w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            [*cli(), "run", str(job), "--plain", *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            code = proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            timed_out = True
            os.killpg(proc.pid, signal.SIGTERM)  # its own session: the supervisor and its child
            try:
                code = proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                code = proc.wait()
    return {"exit_code": code, "timed_out": timed_out, "wall_s": round(time.monotonic() - t0, 1)}


def classify_log(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        done = subprocess.run(
            [*cli(), "classify", str(path), "--json"], capture_output=True, text=True, timeout=120
        )
        return json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr[-400:]}
    except (subprocess.TimeoutExpired, ValueError) as error:
        return {"error": repr(error)}


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            rows.append(json.loads(line))
    return rows


def collect(run_dir: Path, keep: Path) -> dict[str, Any]:
    """Attempts, events and the classify CLI's verdict on each failed attempt's child.log."""
    keep.mkdir(parents=True, exist_ok=True)
    attempts = read_jsonl(run_dir / "attempts.jsonl")
    events = read_jsonl(run_dir / "events.jsonl")
    for name in ("attempts.jsonl", "events.jsonl"):
        if (run_dir / name).is_file():
            shutil.copy(run_dir / name, keep / name)
    for record in attempts:
        number = record["attempt"]
        log = run_dir / f"attempt-{number:03d}" / "child.log"
        if record.get("outcome") != "succeeded" and log.is_file():
            record["_classify_cli"] = classify_log(log)
            text = log.read_text(encoding="utf-8", errors="replace")
            (keep / f"attempt-{number:03d}-child.log.tail").write_text(text[-12000:], encoding="utf-8")
        error = run_dir / f"attempt-{number:03d}" / "error.json"
        if error.is_file():
            shutil.copy(error, keep / f"attempt-{number:03d}-error.json")
    # An attempt in flight when the wall-clock limit hit has no journal line yet.
    state = run_dir / "state.json"
    if state.is_file():
        shutil.copy(state, keep / "state.json")
    return {"attempts": attempts, "events": events}


# --------------------------------------------------------------------------- the table


def gib(value: Any) -> str:
    return "-" if value in (None, 0) else f"{int(value) / GiB:.2f}"


def knob_batch(knobs: dict[str, Any]) -> str:
    micro, accum = knobs.get("micro_batch_size"), knobs.get("grad_accum")
    eff = micro * accum if isinstance(micro, int) and isinstance(accum, int) else "?"
    gc = "gc" if knobs.get("gradient_checkpointing") else "--"
    return f"{micro}x{accum}={eff} {gc} s{knobs.get('max_seq_len', '?')}"


def changes_text(decision: dict[str, Any] | None) -> str:
    if not decision:
        return "-"
    rung = decision.get("rung") or decision.get("action") or "-"
    changes = decision.get("changes") or {}
    parts = [
        f"{k}:{v[0]}->{v[1]}" if isinstance(v, (list, tuple)) and len(v) == 2 else f"{k}:{v}"
        for k, v in changes.items()
    ]
    return f"{rung} [{', '.join(parts)}]" if parts else str(rung)


def table(name: str, result: dict[str, Any]) -> list[str]:
    cols = (
        "att",
        "outcome",
        "kind",
        "stage",
        "tried",
        "allowed",
        "in_use",
        "rsv_free",
        "cli_kind",
        "knobs (micro x accum)",
        "steps res->done",
        "lost",
        "peak_gpu",
        "wall_s",
        "decision",
    )
    rows = []
    for rec in result.get("attempts", []):
        failure = rec.get("failure") or {}
        nums = failure.get("numbers") or {}
        # Journal v2 keeps one peak ({"bytes", "source"}); v1 lines kept a dict of three.
        peak = rec.get("peak") or {}
        old = rec.get("peak_memory") or {}
        cli_kind = (rec.get("_classify_cli") or {}).get("kind", "-")
        rows.append(
            (
                str(rec["attempt"]),
                str(rec.get("outcome")),
                str(failure.get("kind", "-")),
                str(failure.get("stage", "-")),
                gib(nums.get("tried_to_allocate")),
                gib(nums.get("allowed")),
                gib(nums.get("process_in_use")),
                gib(nums.get("reserved_unallocated")),
                str(cli_kind),
                knob_batch(rec.get("knobs") or {}),
                f"{rec.get('resumed_from')}->{rec.get('steps_completed')}",
                str(rec.get("lost_steps")),
                f"{gib(peak.get('bytes') or old.get('child_peak'))}/{peak.get('source') or 'v1'}",
                f"{rec.get('ended_at', 0) - rec.get('started_at', 0):.0f}",
                changes_text(rec.get("decision")),
            )
        )
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(cols)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [f"== scenario {name} ==", fmt.format(*cols), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    attempts = result.get("attempts", [])
    effs = {(r["knobs"]["micro_batch_size"] * r["knobs"]["grad_accum"]) for r in attempts if r.get("knobs")}
    agree = [
        (r.get("failure") or {}).get("kind") == (r.get("_classify_cli") or {}).get("kind")
        for r in attempts
        if r.get("outcome") == "failed"
    ]
    run = result.get("run", {})
    timed_out = " (TIMED OUT)" if run.get("timed_out") else ""
    kept = "yes" if len(effs) == 1 else "NO " + str(sorted(effs))
    lines.append(
        f"exit {run.get('exit_code')}{timed_out}; total {run.get('wall_s')} s; "
        f"attempts {len(attempts)}; effective batch kept: {kept}; "
        f"classify CLI agrees on {sum(agree)}/{len(agree)} failed attempts; "
        f"final steps {attempts[-1].get('steps_completed') if attempts else '-'}"
    )
    lines.append(
        "  (GiB; peak_gpu = the attempt's one peak / where it came from; rsv_free = reserved but unallocated)"
    )
    return lines


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="results directory")
    p.add_argument("--work", type=Path, default=Path("/tmp/gpu_ladder"), help="model, data and runs (large)")
    p.add_argument("--caps", nargs="+", default=["8GiB"], help="one scenario per cap (gpu_memory_limit)")
    p.add_argument("--deadline-s", type=float, default=540.0, help="wall-clock budget for everything")
    p.add_argument("--min-scenario-s", type=float, default=150.0, help="skip a scenario with less time left")
    p.add_argument(
        "--tiny", action="store_true", help="CPU check of this script: tiny model, cpu_memory_limit caps"
    )
    p.add_argument("--gpu", default="0")
    p.add_argument(
        "--as-written", action="store_true", help="run the job's config, no pre-flight (the ladder climbs)"
    )
    p.add_argument(
        "--warm-spare", default="auto", choices=["auto", "true", "false"], help="supervise.warm_spare"
    )
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--effective", type=int, default=16)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--save-steps", type=int, default=2)
    p.add_argument("--rows", type=int, default=160)
    p.add_argument("--_build", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    shape = TINY if args.tiny else LLAMA2_7B
    if args._build:
        info = build_assets(args.work, shape, "cpu" if args.tiny else "cuda", args.rows, args.seq)
        print("BUILD " + json.dumps(info), flush=True)
        return 0

    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {"args": {k: str(v) for k, v in vars(args).items()}, "scenarios": {}}
    results_path = args.out / "results.json"

    def save() -> None:
        results_path.write_text(json.dumps(results, indent=1, default=str), encoding="utf-8")

    if not (args.work / "model" / "config.json").is_file():
        t0 = time.monotonic()
        done = subprocess.run(
            [
                *module_argv(__spec__),
                "--_build",
                "--work",
                str(args.work),
                "--rows",
                str(args.rows),
                "--seq",
                str(args.seq),
                *(["--tiny"] if args.tiny else []),
                "--out",
                str(args.out),
            ],
            capture_output=True,
            text=True,
        )
        line = [x for x in done.stdout.splitlines() if x.startswith("BUILD ")]
        results["build"] = json.loads(line[-1][6:]) if line else {"error": done.stderr[-3000:]}
        results["build"]["wall_s"] = round(time.monotonic() - t0, 1)
        print("build:", json.dumps(results["build"]), flush=True)
        save()
        if done.returncode != 0:
            return 1
    lines: list[str] = []
    for cap in args.caps:
        name = f"cap-{cap}"
        left = args.deadline_s - (time.monotonic() - start)
        if left < args.min_scenario_s:
            results["scenarios"][name] = {"skipped": f"only {left:.0f} s left"}
            lines.append(f"== scenario {name} == skipped: only {left:.0f} s of the deadline left")
            continue
        run_dir = args.work / f"run-{cap}"
        shutil.rmtree(run_dir, ignore_errors=True)
        job = write_job(args.work / f"job-{cap}.yaml", args.work, run_dir, args, cap)
        keep = args.out / name
        keep.mkdir(parents=True, exist_ok=True)
        shutil.copy(job, keep / "job.yaml")
        print(f"running {name} (limit {left - 20:.0f} s) ...", flush=True)
        extra = ("--as-written",) if args.as_written else ()
        run = run_supervised(job, keep / "supervisor.log", left - 20, *extra)
        result = {"run": run, **collect(run_dir, keep)}
        status = subprocess.run([*cli(), "status", str(run_dir)], capture_output=True, text=True)
        (keep / "status.txt").write_text(status.stdout + status.stderr, encoding="utf-8")
        results["scenarios"][name] = result
        save()
        lines += table(name, result)
        (args.out / "table.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    results["total_s"] = round(time.monotonic() - start, 1)
    save()
    lines.append(f"total bench wall time {results['total_s']} s")
    (args.out / "table.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
