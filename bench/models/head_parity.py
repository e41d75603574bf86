"""bf16 embeddings and LM head against the usual fp32 upcast: loss parity, peak memory, tokens/s, a card cap.

    python -m bench.models.head_parity --out OUT [--work /tmp/head_parity] [--steps 60] [--deadline-s 330]
    python -m bench.models.head_parity --out /tmp/hp --tiny --steps 12  # the same on the CPU, tiny shape

The device command of the 2026-12-01 run (issue 19; ``run`` with carry [".whl"]). That run had
every run in one process, which ``--in-process`` reproduces; it was followed, in the same command,
by ``throughput_sweep.py --set repeat``:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \
    python3 -m bench.models.head_parity --in-process --out $OUT --work /tmp/qb --steps 60 --deadline-s 250 \
      > $OUT/parity-console.log 2>&1; \
    python3 -m bench.models.throughput_sweep --out $OUT --work /tmp/qb --set repeat --deadline-s 190 \
      > $OUT/repeat-console.log 2>&1; cat $OUT/parity.txt $OUT/table-repeat.txt

In one process, memory leaked from run to run (``start_allocated``; 2-3 GiB of the 8B's,
see bench/results/throughput-h200-2026-12-01/RESULTS.md), which inflated the later runs' peaks
and made both 8 GiB runs fail in the load. So each run now gets a fresh process by default (the
same command without ``--in-process``; not yet run on the GPU in that form).

``prepare_model_for_kbit_training`` upcasts every parameter that is not 4-bit to fp32, the
embeddings and the LM head included (2.1 GB each in fp32 at a 128k vocabulary). The variant keeps
those two in bf16 (``_qlora_bench.prepare``: they are parked on the host while peft upcasts, so the
GPU never holds their fp32 copies); the norms stay fp32 in both.

Runs, each in a fresh process (``--in-process``: all in this one), on a Llama-3-8B shape (128k
vocabulary) built with random weights, each from a fresh 4-bit load with the same seed (so the
same LoRA init, dropout masks and data order), seq 2048, micro-batch 1, accumulation 1,
checkpointing, LoRA r 8 on q/k/v/o, paged_adamw_8bit, the recipe's schedule (2e-4 cosine, warmup
0.03, max_grad_norm 0.3), on learnable rows (a random motif repeated, ``_qlora_bench.motif_rows``):

1. ``upcast``: ``--steps`` optimizer steps, the usual recipe;
2. ``bf16``: the same with the embeddings and head in bf16;
3. ``cap-bf16`` / ``cap-upcast``: a few steps each under an 8 GiB cap
   (``torch.cuda.set_per_process_memory_fraction``, set before the load): does it train, and where
   does it run out of memory if not;
4. ``upcast-repeat``: run 1 again, for the run-to-run noise floor of the loss (non-deterministic
   kernels), if time is left.

Per run: every step's exact loss, grad norm and interval, tokens/s (median after two warm-up
steps), peak allocated/reserved during load+prepare and during training (the weights included).
Writes ``OUT/parity.jsonl`` (a record per run, appended as it goes) and ``OUT/parity.txt``.
Not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .._launch import module_argv
from . import _qlora_bench as qb

SHAPE = "8b-128k"
R = 8
OPTIMIZER = "paged_adamw_8bit"
CAP = 8 * qb.GiB
WARMUP = 2
RESULT = "RESULT "


def run_variant(name: str, head: str, steps: int, seq: int, work: Path, cap: int | None) -> dict[str, Any]:
    """A fresh load, ``prepare`` with ``head``, LoRA, ``steps`` optimizer steps; an OOM anywhere is
    a result (with the stage it hit), not a failure of the bench."""
    import torch
    from transformers import AutoTokenizer

    qb.free()
    record: dict[str, Any] = {"kind": "run", "name": name, "head": head, "steps": steps, "seq": seq}
    record |= {"micro": 1, "checkpointing": True, "r": R, "optimizer": OPTIMIZER, "cap": cap}
    # Anything here is left over from an earlier run in this process (none in a fresh one): the
    # 2026-12-01 in-process run had 2-3 GiB there, which is why runs now get a process each.
    record["start_allocated"] = qb.memory()["allocated"]
    if cap is not None and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(cap / total)
    clock = qb.make_clock()
    stage = "load"
    model: Any = None
    trainer: Any = None
    error: BaseException | None = None
    started = time.monotonic()
    try:
        with qb.quiet():
            model = qb.load_4bit(work / SHAPE)
            stage = "prepare"
            model = qb.prepare(model, head, checkpointing=True)
            record["prepared_allocated"] = qb.memory()["allocated"]  # the head's bytes show here
            record["dtypes"] = {
                "embeddings": str(model.get_input_embeddings().weight.dtype),
                "lm_head": str(model.get_output_embeddings().weight.dtype),
                "norm": str(model.model.norm.weight.dtype),
            }
            stage = "lora"
            model = qb.add_lora(model, R)
            record["setup"] = qb.memory()  # peaks of load + prepare + LoRA
            qb.free()  # training peaks from here (the weights stay allocated)
            stage = "trainer"
            rows = qb.motif_rows(steps, seq, model.get_base_model().config.vocab_size, seed=qb.SEED)
            args = qb.sft_config(work / "scratch", 1, seq, OPTIMIZER, True, steps)
            trainer = qb.trainer(model, AutoTokenizer.from_pretrained(work / SHAPE), args, rows, clock)
            stage = "train"
            trainer.train()
        record["status"] = "ok"
    except torch.OutOfMemoryError as exc:
        record |= {"status": "oom", "oom_stage": clock.phase if stage == "train" else stage}
        record |= {"oom_step": len(clock.step) + 1 if stage == "train" else None, "message": qb.oom_text(exc)}
        error = exc
    except Exception as exc:  # a bench records what went wrong and goes on to the next run
        record |= {"status": "error", "stage": stage, "message": f"{type(exc).__name__}: {qb.oom_text(exc)}"}
        error = exc
    record["train"] = qb.memory()
    losses = [float(x) for x in trainer.step_losses] if trainer is not None else []
    record |= {"losses": losses, "grad_norms": [log.get("grad_norm") for log in clock.logs]}
    record |= measured(clock, seq)
    record["wall_s"] = round(time.monotonic() - started, 1)
    del model, trainer, error  # the traceback of an OOM holds tensors
    qb.free()
    if cap is not None and torch.cuda.is_available():
        torch.cuda.set_per_process_memory_fraction(1.0)
    return record


def run_in_child(name: str, head: str, steps: int, args: argparse.Namespace) -> dict[str, Any]:
    """``run_variant`` in a fresh process: nothing an earlier run left behind (allocator state,
    references held by a library) is in its numbers, and a cap applies from the load on, as it
    would to the trainer child."""
    cap = CAP if name.startswith("cap-") else None
    argv = [*module_argv(__spec__), "--out", str(args.out), "--work", str(args.work)]
    argv += ["--_variant", name, head, str(steps), *(["--_cap", str(cap)] if cap else [])]
    argv += ["--tiny"] if args.tiny else []
    done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    lines = [x for x in done.stdout.splitlines() if x.startswith(RESULT)]
    if lines:
        record: dict[str, Any] = json.loads(lines[-1][len(RESULT) :])
        return record
    return {
        "kind": "run",
        "name": name,
        "head": head,
        "status": "crashed",
        "exit_code": done.returncode,
        "message": done.stdout[-2000:],
        "losses": [],
        "train": qb.memory() | {"max_allocated": None, "max_reserved": None},
        "steps_done": 0,
        "tokens_per_s": None,
        "s_per_step": None,
    }


def measured(clock: Any, seq: int) -> dict[str, Any]:
    per_step = qb.median_after(clock.interval, WARMUP - 1)
    return {
        "s_per_step": per_step,
        "tokens_per_s": round(seq / per_step, 1) if per_step else None,
        "intervals": [round(x, 4) for x in clock.interval],
        "steps_done": len(clock.step),
    }


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Per-step |loss_a - loss_b| over the steps both have: max, mean, and the final step's."""
    pairs = list(zip(a["losses"], b["losses"], strict=False))
    if not pairs:
        return {"kind": "compare", "a": a["name"], "b": b["name"], "steps": 0}
    diffs = [abs(x - y) for x, y in pairs]
    worst = max(range(len(diffs)), key=diffs.__getitem__)
    return {
        "kind": "compare",
        "a": a["name"],
        "b": b["name"],
        "steps": len(pairs),
        "max_abs_diff": max(diffs),
        "max_at_step": worst + 1,
        "mean_abs_diff": statistics.fmean(diffs),
        "final_diff": pairs[-1][1] - pairs[-1][0],
        "final_a": pairs[-1][0],
        "final_b": pairs[-1][1],
        "first_a": pairs[0][0],
        "max_rel_diff": max(d / abs(x) for d, (x, _) in zip(diffs, pairs, strict=True) if x),
    }


def report(runs: list[dict[str, Any]], comparisons: list[dict[str, Any]]) -> list[str]:
    lines = [
        "run            status  steps  tok/s   s/step   train alloc/rsv GiB  setup peak GiB  first/last loss"
    ]
    for r in runs:
        t, s = r["train"], r.get("setup") or {}
        losses = r["losses"]
        ends = f"{losses[0]:.4f} / {losses[-1]:.4f}" if losses else "-"
        lines.append(
            f"{r['name']:<14} {r['status']:<7} {r['steps_done']:>5}  {r['tokens_per_s'] or '-':>6}  "
            f"{r['s_per_step'] or '-':>7}  {qb.gib(t['max_allocated']):>6} / {qb.gib(t['max_reserved']):<10} "
            f"{qb.gib(s.get('max_allocated')):>12}    {ends}"
        )
        if r["status"] != "ok":
            lines.append(f"    {r.get('oom_stage') or r.get('stage')}: {r.get('message', '')[:300]}")
    for c in comparisons:
        if c["steps"]:
            lines.append(
                f"{c['b']} vs {c['a']} over {c['steps']} steps: max |diff| {c['max_abs_diff']:.5f} "
                f"(step {c['max_at_step']}), mean {c['mean_abs_diff']:.5f}, final {c['final_diff']:+.5f} "
                f"({c['final_a']:.5f} vs {c['final_b']:.5f}), max relative {c['max_rel_diff']:.2e}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/head_parity"))
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--cap-steps", type=int, default=5)
    p.add_argument("--deadline-s", type=float, default=330.0, help="no run starts after this")
    p.add_argument("--tiny", action="store_true", help="CPU check of this script with the tiny shape")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="all runs in this process, one after another (how the 2026-12-01 run went; it leaks "
        "memory from run to run, see start_allocated)",
    )
    p.add_argument("--_variant", nargs=3, metavar=("NAME", "HEAD", "STEPS"), help=argparse.SUPPRESS)
    p.add_argument("--_cap", type=int, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    start = time.monotonic()
    seq = 64 if args.tiny else 2048
    if args._variant:  # one run in this (fresh) process, its record on stdout
        name, head, steps = args._variant
        record = run_variant(name, head, int(steps), seq, args.work, args._cap)
        print(RESULT + json.dumps(record, default=str), flush=True)
        return 0
    journal = qb.Journal(args.out / "parity.jsonl")
    journal.path.unlink(missing_ok=True)  # a fresh journal per bench run (the children write none)
    built = qb.build_all([SHAPE], args.work, args.tiny)
    journal.write(qb.environment() | {"build": built, "build_wall_s": round(time.monotonic() - start, 1)})
    plan = [
        ("upcast", "upcast", args.steps, None),
        ("bf16", "bf16", args.steps, None),
        ("cap-bf16", "bf16", args.cap_steps, CAP),
        ("cap-upcast", "upcast", args.cap_steps, CAP),
        ("upcast-repeat", "upcast", args.steps, None),
    ]
    runs: list[dict[str, Any]] = []
    for name, head, steps, cap in plan:
        if time.monotonic() > start + args.deadline_s:
            journal.write({"kind": "run", "name": name, "status": "deadline_not_run"})
            continue
        if args.in_process:
            runs.append(run_variant(name, head, steps, seq, args.work, cap))
        else:
            runs.append(run_in_child(name, head, steps, args))
        journal.write(runs[-1])
        print(report(runs[-1:], [])[-1], flush=True)
    by_name = {r["name"]: r for r in runs}
    comparisons = [
        compare(by_name[a], by_name[b])
        for a, b in (("upcast", "bf16"), ("upcast", "upcast-repeat"))
        if a in by_name and b in by_name
    ]
    for c in comparisons:
        journal.write(c)
    lines = [*report(runs, comparisons), f"total {time.monotonic() - start:.0f} s"]
    (args.out / "parity.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
