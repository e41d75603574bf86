"""Seconds per QLoRA micro-step on one GPU, alone on the card: the sweep a throughput model is fitted on.

    python -m bench.models.throughput_sweep --out OUT [--work /tmp/throughput] [--deadline-s 520]
    python -m bench.models.throughput_sweep --out /tmp/ts --tiny  # the same logic on the CPU, tiny shapes

The device command of the 2026-12-01 run (issue 19; ``run`` with carry [".whl"]); that run had
all shapes in one process, which ``--in-process`` reproduces:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
      .whl/*.whl && export PYTHONPATH=/tmp/site || exit; \
    python3 -m bench.models.throughput_sweep --in-process --out $OUT --deadline-s 490 \
      > $OUT/console.log 2>&1; \
    cat $OUT/table.txt

In one process each model left its fp32 LM head allocated after it was deleted, so the later
shapes' peaks include the earlier shapes' heads (``start_allocated``; the 1B's +1.96 GiB, the
7B's +3.0 GiB; times are not affected). Each shape now gets a fresh process by default (the same
command without ``--in-process``; not yet run on the GPU in that form).

What it does:

1. builds the three shapes of ``_qlora_bench.SHAPES`` (Llama-2-7B 32k vocabulary, Llama-3-8B and
   Llama-3.2-1B 128k) as random bf16 weights on the GPU, ``save_pretrained`` to local disk, in
   parallel subprocesses, before anything is timed;
2. per shape, in a process of its own: one 4-bit load (NF4, double quant, bf16 compute),
   ``prepare_model_for_kbit_training``, LoRA r 16 on q/k/v/o, then one trl SFTTrainer per config
   on that model (checkpointing switched on or off on it; the optimizer and trainer are new per
   config); between configs the caches are emptied and the peak statistics reset;
3. per config, ``warmup + timed`` optimizer steps at accumulation 1 (so one step = one micro-step,
   the optimizer included; ``fwd_bwd_s`` and ``optimizer_s`` split it) on rows of exactly ``seq``
   random token ids: the median over the timed steps of the step-to-step interval, tokens/s =
   micro x seq / that, ``torch.cuda.max_memory_allocated/reserved`` (the weights included), or
   ``oom`` with the message. A config whose smaller micro-batch already ran out of memory (same
   shape, seq and checkpointing) is not run and is recorded as ``oom_not_run``.

Writes ``OUT/sweep.jsonl`` (one record per shape and per config, appended as it goes) and
``OUT/table.txt``; prints the table last. Not a test.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .._launch import module_argv
from . import _qlora_bench as qb

R = 16
PAGED = "paged_adamw_8bit"
TORCH_ADAMW = "adamw_torch"
#: Measured per shape, in this order: largest shape first, so a deadline cuts the cheap extras.
SHAPE_ORDER = ("8b-128k", "1b-128k", "7b-32k")


@dataclasses.dataclass(frozen=True)
class Config:
    shape: str
    seq: int
    micro: int
    checkpointing: bool
    optimizer: str = PAGED
    timed_steps: int | None = None  # None: by tokens (``timed``)

    @property
    def tokens(self) -> int:
        return self.seq * self.micro

    @property
    def warmup(self) -> int:
        # Step 1 creates the optimizer state and tunes kernels for the shape; step 2 is the first
        # whose interval exists (it is measured from the end of step 1).
        return 2

    @property
    def timed(self) -> int:
        # Fewer timed steps where one takes seconds: the spread there is small against the step.
        if self.timed_steps is not None:
            return self.timed_steps
        return 4 if self.tokens <= 8192 else 3

    @property
    def name(self) -> str:
        ckpt = "ckpt" if self.checkpointing else "no-ckpt"
        return f"{self.shape} s{self.seq} b{self.micro} {ckpt} {self.optimizer}"


def configs_for(shape: str, tiny: bool) -> list[Config]:
    """Micro-batch 1..16 x checkpointing at seq 2048 with paged 8-bit AdamW; 32-bit AdamW at
    micro 1 and 4; on the 7B also seq 512 and 1024 (the per-token cost against sequence length)."""
    seq = 64 if tiny else 2048
    micros = (1, 2, 4) if tiny else (1, 2, 4, 8, 16)
    out = [Config(shape, seq, m, ckpt) for ckpt in (True, False) for m in micros]
    out += [Config(shape, seq, m, ckpt, TORCH_ADAMW) for ckpt in (True, False) for m in (1, 4)]
    if shape == "7b-32k":
        for short in (16, 32) if tiny else (512, 1024):
            out += [Config(shape, short, m, ckpt) for ckpt in (True, False) for m in (1, 4, 16)]
    return out


def repeat_configs_for(shape: str, tiny: bool) -> list[Config]:
    """``--set repeat``: the points where a step is shortest and the spread largest (micro 1 and 2
    at seq 2048), again with 6 timed steps, 32-bit AdamW first, to show the noise and whether the
    sweep's order (paged 8-bit always before 32-bit AdamW) moved the optimizers' numbers."""
    seq = 64 if tiny else 2048
    order = (TORCH_ADAMW, PAGED)
    return [
        Config(shape, seq, m, ckpt, opt, timed_steps=6)
        for opt in order
        for ckpt in (True, False)
        for m in (1, 2)
    ]


def run_config(model: Any, tokenizer: Any, config: Config, vocab: int, scratch: Path) -> dict[str, Any]:
    """One config on the loaded model; an OOM is a result, not a failure of the sweep."""
    import torch

    qb.free()
    base = qb.memory()["allocated"]
    clock = qb.make_clock()
    steps = config.warmup + config.timed
    record: dict[str, Any] = {"kind": "config", **dataclasses.asdict(config), "r": R, "steps": steps}
    started = time.monotonic()
    error: BaseException | None = None
    trainer: Any = None
    try:
        qb.set_checkpointing(model, config.checkpointing)
        rows = qb.random_rows(config.micro * steps, config.seq, vocab, seed=config.micro * 7919 + config.seq)
        args = qb.sft_config(scratch, config.micro, config.seq, config.optimizer, config.checkpointing, steps)
        with qb.quiet():
            trainer = qb.trainer(model, tokenizer, args, rows, clock)
            trainer.train()
        record["status"] = "ok"
        record["checkpointing_active"] = qb.checkpointing_active(model)
    except torch.OutOfMemoryError as exc:
        record |= {"status": "oom", "oom_phase": clock.phase, "oom_step": len(clock.step) + 1}
        record["message"] = qb.oom_text(exc)
        error = exc
    except Exception as exc:  # a bench records what went wrong and goes on to the next config
        record |= {"status": "error", "message": f"{type(exc).__name__}: {qb.oom_text(exc)}"}
        error = exc
    record |= qb.memory()
    record["base_allocated"] = base
    del error, trainer  # the traceback holds the step's tensors: drop it before the next config
    model.zero_grad(set_to_none=True)
    qb.unpatch_forward(model)
    record["wall_s"] = round(time.monotonic() - started, 2)
    return record | timing(clock, config)


def timing(clock: Any, config: Config) -> dict[str, Any]:
    # interval[i] ends step i + 2; skipping warmup - 1 of them leaves the timed steps.
    per_step = qb.median_after(clock.interval, config.warmup - 1)
    losses = [log["loss"] for log in clock.logs]
    return {
        "s_per_micro_step": per_step,
        "tokens_per_s": round(config.tokens / per_step, 1) if per_step else None,
        "fwd_bwd_s": qb.median_after(clock.fwd_bwd, config.warmup),
        "optimizer_s": qb.median_after(clock.optim, config.warmup),
        "step_s": qb.median_after(clock.step, config.warmup),
        "intervals": [round(x, 4) for x in clock.interval],
        "first_step_s": round(clock.step[0], 3) if clock.step else None,
        "last_loss": losses[-1] if losses else None,
    }


def sweep_shape(
    name: str, configs: list[Config], work: Path, tiny: bool, journal: qb.Journal, deadline: float
) -> list[dict[str, Any]]:
    """Load ``name`` once, run its configs, free it. ``deadline``: epoch seconds (``time.time()``),
    the same clock in a child process as in its parent."""
    from transformers import AutoTokenizer

    qb.free()
    # Left over from an earlier shape in this process (0 in a fresh one): in the 2026-12-01 run each
    # model left its fp32 LM head allocated, which is why each shape now gets a process of its own.
    start_allocated = qb.memory()["allocated"]
    t0 = time.monotonic()
    with qb.quiet():
        model = qb.load_4bit(work / name)
    loaded = qb.memory()
    load_s = time.monotonic() - t0
    weights = qb.weight_bytes(model)
    model = qb.prepare(model, "upcast", checkpointing=True)
    model = qb.add_lora(model, R)
    tokenizer = AutoTokenizer.from_pretrained(work / name)
    vocab = model.get_base_model().config.vocab_size
    journal.write(
        {
            "kind": "shape",
            "shape": name,
            "config": (qb.TINY_SHAPES if tiny else qb.SHAPES)[name],
            "load_s": round(load_s, 2),
            "start_allocated": start_allocated,
            "allocated_after_load": loaded["allocated"],
            "allocated_after_prepare": qb.memory()["allocated"],
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "total_params": sum(p.numel() for p in model.parameters()),
            **weights,
        }
    )
    results: list[dict[str, Any]] = []
    oomed: set[tuple[int, bool, str]] = set()
    scratch = work / "scratch"
    for config in configs:
        key = (config.seq, config.checkpointing, config.optimizer)
        if key in oomed:
            record = {"kind": "config", **dataclasses.asdict(config), "r": R, "status": "oom_not_run"}
        elif time.time() > deadline:
            record = {"kind": "config", **dataclasses.asdict(config), "r": R, "status": "deadline_not_run"}
        else:
            record = run_config(model, tokenizer, config, vocab, scratch)
        if record["status"] == "oom":
            oomed.add(key)
        journal.write(record)
        results.append(record)
        print(f"  {config.name}: {summary(record)}", flush=True)
    del model
    qb.free()
    shutil.rmtree(scratch, ignore_errors=True)
    return results


def summary(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['status']} {r.get('message', '')[:120]}"
    return (
        f"{r['s_per_micro_step']} s/micro-step, {r['tokens_per_s']} tok/s, "
        f"{qb.gib(r['max_allocated'])}/{qb.gib(r['max_reserved'])} GiB"
    )


def table(results: list[dict[str, Any]]) -> list[str]:
    cols = ("shape", "seq", "micro", "ckpt", "optimizer", "s/micro", "tok/s", "fwd+bwd", "optim",
            "alloc GiB", "rsv GiB", "status")  # fmt: skip
    rows = []
    for r in results:
        ok = r["status"] == "ok"
        rows.append(
            (
                r["shape"], str(r["seq"]), str(r["micro"]), "on" if r["checkpointing"] else "off",
                r["optimizer"],
                f"{r['s_per_micro_step']:.4f}" if ok else "-",
                f"{r['tokens_per_s']:.0f}" if ok else "-",
                f"{r['fwd_bwd_s']:.4f}" if ok else "-",
                f"{r['optimizer_s']:.4f}" if ok else "-",
                qb.gib(r.get("max_allocated")) if ok else "-",
                qb.gib(r.get("max_reserved")) if ok else "-",
                r["status"],
            )
        )  # fmt: skip
    widths = [max(len(c), *(len(x[i]) for x in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    return [line.format(*cols), line.format(*("-" * w for w in widths)), *(line.format(*x) for x in rows)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/throughput"))
    p.add_argument("--deadline-s", type=float, default=520.0, help="no config starts after this")
    p.add_argument("--shapes", nargs="*", default=None, choices=SHAPE_ORDER, help="default: all")
    p.add_argument("--set", choices=("sweep", "repeat"), default="sweep")
    p.add_argument("--tiny", action="store_true", help="CPU check of this script with tiny shapes")
    p.add_argument(
        "--in-process",
        action="store_true",
        help="all shapes in this process, one after another (how the 2026-12-01 run went; each "
        "shape leaked its LM head into the next ones' memory numbers, see start_allocated)",
    )
    p.add_argument("--_shape", help=argparse.SUPPRESS)
    p.add_argument("--_deadline", type=float, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    start = time.monotonic()
    args.out.mkdir(parents=True, exist_ok=True)
    repeat = args.set == "repeat"
    # The repeat goes through the shapes in the other order too (smallest weights in the middle).
    shapes = args.shapes or list(reversed(SHAPE_ORDER) if repeat else SHAPE_ORDER)
    pick = repeat_configs_for if repeat else configs_for
    path = args.out / ("sweep-repeat.jsonl" if repeat else "sweep.jsonl")
    journal = qb.Journal(path)
    if args._shape:  # one shape in this (fresh) process; the parent reads its records from the journal
        sweep_shape(args._shape, pick(args._shape, args.tiny), args.work, args.tiny, journal, args._deadline)
        return 0
    path.unlink(missing_ok=True)
    built = qb.build_all(shapes, args.work, args.tiny)
    print("build:", built, f"({time.monotonic() - start:.0f} s)", flush=True)
    journal.write(qb.environment() | {"build": built, "build_wall_s": round(time.monotonic() - start, 1)})
    deadline = time.time() + args.deadline_s - (time.monotonic() - start)
    for name in shapes:
        if args.in_process:
            sweep_shape(name, pick(name, args.tiny), args.work, args.tiny, journal, deadline)
            continue
        # A process per shape: nothing the last model left allocated is in this one's numbers.
        argv_child = [*module_argv(__spec__), "--out", str(args.out), "--work", str(args.work)]
        argv_child += ["--set", args.set, "--_shape", name, "--_deadline", str(deadline)]
        subprocess.run([*argv_child, *(["--tiny"] if args.tiny else [])], check=False)
    results = [r for r in qb.read_jsonl(path) if r.get("kind") == "config"]
    lines = [*table(results), f"total {time.monotonic() - start:.0f} s"]
    (args.out / ("table-repeat.txt" if repeat else "table.txt")).write_text(
        "\n".join(lines) + "\n", encoding="utf-8"
    )
    print("\n".join(lines), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
