"""The memory model against real QLoRA steps: peak allocated, predicted vs measured, and rung costs.

    python -m bench.models.memory_grid --out OUT [--work /tmp/memory_grid] [--parallel 5] [--deadline-s 500]
    python -m bench.models.memory_grid --out OUT --set rungs        # tokens/s of each rung, one at a time
    python -m bench.models.memory_grid --out /tmp/g --tiny  # the same pipeline on the CPU, tiny shapes
    python -m bench.models.memory_grid --out OUT --set families     # issue 20's families (--tiny: on the CPU)

What it does:

1. builds the shapes it needs, each once, in a subprocess on the GPU: random bf16 weights,
   ``save_pretrained``, a word-level tokenizer trained locally and a jsonl dataset whose rows are
   all longer than the longest sequence (so every sample is truncated to exactly ``max_seq_len``):
   ``7b-32k`` (Llama-2-7B: hidden 4096, 32 layers, 32 heads, MLP 11008, vocab 32000, untied),
   ``8b-128k`` (Llama-3-8B: 8 kv heads, MLP 14336, vocab 128256, untied) and ``1b-128k``
   (Llama-3.2-1B: hidden 2048, 16 layers, 8 kv heads, MLP 8192, vocab 128256, tied);
2. runs OUR trainer child (``python -m qlora_supervise.trainer_child --spec``, through a thin
   wrapper that writes ``torch.cuda.max_memory_allocated/reserved`` when the child returns) once
   per config, in a fresh process, several at once on the one GPU (peak allocated is per
   process; admission keeps the sum of predicted peaks under the card);
3. reads the child's events (memory after load, per-step tokens/s, RSS peak) and the wrapper's
   numbers, and writes ``OUT/memory-grid.json`` and ``OUT/table.txt`` (predicted vs measured).

``--set rungs`` runs the rung-cost set on the 7B alone, one config at a time (nothing else on
the GPU): baseline, + gradient checkpointing, half micro-batch with double accumulation,
paged_adamw_8bit instead of adamw_torch, expandable_segments on; tokens/s is the median of the
per-step numbers after the first two steps. Not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .._launch import module_argv
from ..scenarios.gpu_ladder import long_rows

if TYPE_CHECKING:
    from qlora_supervise.trainer_child.contract.spec import Knobs

GiB = 1 << 30
ROOT = Path(__file__).resolve().parents[2]
SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>"]

SHAPES: dict[str, dict[str, Any]] = {
    "7b-32k": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    "8b-128k": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    "1b-128k": dict(
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=True,
    ),
}
#: The families of issue 20 at their released widths (``model_type`` picks the transformers
#: class). Qwen3-MoE keeps Qwen3-30B-A3B's block but 16 layers of 32 experts: the released 48 x 128
#: fp32 experts (116 GB once prepared) fit no card, which ``plan`` says for the real config.
FAMILY_SHAPES: dict[str, dict[str, Any]] = {
    "gemma2-2b": dict(
        model_type="gemma2", hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000,
        tie_word_embeddings=True, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
        sliding_window=4096, query_pre_attn_scalar=256,
    ),
    "gemma3-1b": dict(
        model_type="gemma3_text", hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, vocab_size=262144,
        tie_word_embeddings=True, sliding_window=512, query_pre_attn_scalar=256,
    ),
    "phi3-mini": dict(
        model_type="phi3", hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
        tie_word_embeddings=False, sliding_window=2047,
    ),
    "qwen3-4b": dict(
        model_type="qwen3", hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=True,
    ),
    "qwen3moe-16x32": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_experts=32, num_experts_per_tok=8, num_hidden_layers=16, num_attention_heads=32,
        num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=False,
    ),
}  # fmt: skip
SHAPES.update(FAMILY_SHAPES)
#: CPU stand-ins with the same structure (MHA / GQA untied / GQA tied); intermediate sizes are
#: multiples of 32 (bitsandbytes' CPU 4-bit path, see trainer_child/recipe/tiny.py).
TINY_SHAPES: dict[str, dict[str, Any]] = {
    "7b-32k": dict(SHAPES["7b-32k"], hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, vocab_size=512),
    "8b-128k": dict(SHAPES["8b-128k"], hidden_size=128, intermediate_size=448, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=2048),
    "1b-128k": dict(SHAPES["1b-128k"], hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=2048),
}  # fmt: skip
#: The families small: each one's block, few layers and narrow widths (multiples of 32).
TINY_SHAPES.update(
    {
        name: dict(
            shape, hidden_size=128, intermediate_size=256, num_hidden_layers=2, vocab_size=2048,
            num_attention_heads=4, num_key_value_heads=2 if shape["num_key_value_heads"] > 1 else 1,
            **({"head_dim": 32} if "head_dim" in shape else {}),
            **({"moe_intermediate_size": 64, "num_experts": 4, "num_experts_per_tok": 2}
               if "num_experts" in shape else {}),
        )
        for name, shape in FAMILY_SHAPES.items()
    }
)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Config:
    """One grid point: a shape and the knobs/targets the memory model reads."""

    shape: str
    seq: int
    micro: int
    gc: bool
    r: int = 8
    targets: str = "qkvo"  # "qkvo" or "all-linear"
    optimizer: str = "paged_adamw_8bit"
    accum: int = 1
    expandable: bool = False
    steps: int = 3

    @property
    def name(self) -> str:
        return (
            f"{self.shape} s{self.seq} b{self.micro}x{self.accum} {'gc' if self.gc else 'nogc'} "
            f"r{self.r} {self.targets} {self.optimizer}{' exp' if self.expandable else ''}"
        )

    def knobs(self, model: str = "m") -> Knobs:
        """The knobs the child runs this point with (and the memory model predicts it with)."""
        from qlora_supervise.trainer_child.contract.spec import Knobs

        return Knobs(
            model=model,
            micro_batch_size=self.micro,
            grad_accum=self.accum,
            max_seq_len=self.seq,
            gradient_checkpointing=self.gc,
            optimizer=self.optimizer,
            lora_r=self.r,
            lora_alpha=2 * self.r,
            expandable_segments=self.expandable,
            eval_enabled=False,
        )

    @property
    def target_modules(self) -> tuple[str, ...] | str:
        # "attention": each family's own names (q/k/v/o, or Phi-3's qkv_proj and o_proj).
        return "attention" if self.targets == "qkvo" else "all-linear"


def grid() -> list[Config]:
    """The grid: every shape across seq 512..8192, micro-batch, checkpointing, rank, targets, optimizer."""
    c = Config
    return [
        # 7B, 32k vocabulary, multi-head attention
        c("7b-32k", 512, 1, True),
        c("7b-32k", 2048, 1, True),
        c("7b-32k", 2048, 4, False),
        c("7b-32k", 2048, 4, True),
        c("7b-32k", 4096, 1, False, r=16, optimizer="adamw_torch"),
        c("7b-32k", 8192, 1, True),
        c("7b-32k", 1024, 2, False, r=64, targets="all-linear", optimizer="adamw_torch"),
        c("7b-32k", 2048, 2, True, r=256, targets="all-linear", optimizer="adamw_torch"),
        c("7b-32k", 512, 8, False, optimizer="paged_adamw_32bit"),
        c("7b-32k", 4096, 2, True, r=32, optimizer="adamw_8bit"),
        c("7b-32k", 2048, 4, False, expandable=True),
        # 8B, 128k vocabulary untied, grouped-query attention
        c("8b-128k", 512, 1, True),
        c("8b-128k", 2048, 1, True, r=16, targets="all-linear"),
        c("8b-128k", 2048, 2, False),
        c("8b-128k", 4096, 1, True, optimizer="adamw_torch"),
        c("8b-128k", 8192, 1, True),
        c("8b-128k", 1024, 4, False),
        c("8b-128k", 8192, 1, False),
        c("8b-128k", 4096, 2, True, r=64, targets="all-linear", optimizer="adamw_torch"),
        c("8b-128k", 4096, 1, True, expandable=True),
        # 1B, 128k vocabulary tied
        c("1b-128k", 512, 1, False),
        c("1b-128k", 2048, 1, True),
        c("1b-128k", 2048, 4, False, r=16, targets="all-linear"),
        c("1b-128k", 4096, 4, True, optimizer="adamw_torch"),
        c("1b-128k", 8192, 1, False),
        c("1b-128k", 8192, 2, True, r=32, targets="all-linear", optimizer="paged_adamw_32bit"),
        c("1b-128k", 1024, 8, False, optimizer="adamw_8bit"),
        c("1b-128k", 4096, 1, False, r=128, targets="all-linear", optimizer="adamw_torch"),
    ]


def family_grid() -> list[Config]:
    """Issue 20's grid: per family, seq 512..8192, checkpointing on/off, micro-batch, rank, optimizer."""
    c = Config
    points = []
    for name in FAMILY_SHAPES:
        points += [
            c(name, 512, 1, False),
            c(name, 2048, 1, True),
            c(name, 2048, 2, False, r=16),
            c(name, 4096, 1, True, optimizer="adamw_torch"),
            c(name, 8192, 1, True, r=32),
            c(name, 1024, 4, False, targets="all-linear", optimizer="adamw_8bit"),
        ]
    return points


def tiny_family_grid() -> list[Config]:
    return [Config(name, 64, 2, gc, steps=2) for name in FAMILY_SHAPES for gc in (False, True)]


def rung_set() -> list[Config]:
    """The rung costs on the 7B: each rung alone against one baseline (effective batch 8)."""
    base = Config("7b-32k", 2048, 4, False, r=16, optimizer="adamw_torch", accum=2, steps=8)
    return [
        base,
        dataclasses.replace(base, gc=True),
        dataclasses.replace(base, micro=2, accum=4),
        dataclasses.replace(base, optimizer="paged_adamw_8bit"),
        dataclasses.replace(base, expandable=True),
        dataclasses.replace(base, gc=True, micro=2, accum=4),
    ]


def tiny_grid() -> list[Config]:
    c = Config
    return [
        c("7b-32k", 64, 1, True, steps=2),
        c("8b-128k", 128, 2, False, targets="all-linear", optimizer="adamw_torch", steps=2),
        c("1b-128k", 64, 2, True, r=4, steps=2),
    ]


# --------------------------------------------------------------------------- building


# The dataset rows are gpu_ladder's: one builder of counting exercises for every GPU bench.


def build_assets(
    work: Path, shape: dict[str, Any], device: str, rows: int, min_tokens: int
) -> dict[str, Any]:
    """Model (random bf16 weights), tokenizer and dataset under ``work``; runs in a subprocess."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

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
        model_max_length=16384,
    )
    torch.manual_seed(0)
    sizes = dict(shape)
    config = AutoConfig.for_model(
        sizes.pop("model_type", "llama"),
        pad_token_id=0, bos_token_id=2, eos_token_id=3, max_position_embeddings=16384, **sizes,
    )  # fmt: skip
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    # Shards of 5 GB: the plan command reads the index, as it would for a downloaded model.
    # Written beside and renamed: build_all skips a shape whose model/config.json exists, and a
    # save cut short (a full disk) leaves config.json without its weights.
    partial = work / "model.partial"
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial, max_shard_size="5GB")
    tokenizer.save_pretrained(partial)
    shutil.rmtree(work / "model", ignore_errors=True)
    partial.rename(work / "model")
    return {"params": params, "vocab_used": len(tokenizer), "build_s": round(time.monotonic() - t0, 1)}


def build_all(names: list[str], work: Path, tiny: bool, max_seq: int) -> dict[str, Any]:
    """Build the missing shapes in parallel subprocesses (this process never touches the GPU)."""
    procs: dict[str, subprocess.Popen[str]] = {}
    for name in names:
        if (work / name / "model" / "config.json").is_file():
            continue
        argv = [*module_argv(__spec__), "--_build", name, "--work", str(work), "--out", str(work)]
        argv += ["--max-seq", str(max_seq), *(["--tiny"] if tiny else [])]
        procs[name] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    info: dict[str, Any] = {}
    for name, proc in procs.items():
        out, _ = proc.communicate()
        lines = [x for x in out.splitlines() if x.startswith("BUILD ")]
        info[name] = json.loads(lines[-1][6:]) if lines else {"error": out[-3000:]}
    return info


# --------------------------------------------------------------------------- one config


def write_spec(config: Config, work: Path, run: Path, tiny: bool) -> Path:
    from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DataSpec, TrainSpec

    shape_dir = work / config.shape
    knobs = config.knobs(str(shape_dir / "model"))
    train = TrainSpec(
        max_steps=config.steps,
        save_steps=10_000,
        logging_steps=1,
        target_modules=config.target_modules,
        compute_dtype="auto",
        warmup_ratio=0.0,
    )
    spec = AttemptSpec(
        attempt=1,
        run_dir=str(run),
        knobs=knobs,
        data=DataSpec(path=str(shape_dir / "data.jsonl")),
        train=train,
        events_file=str(run / "events.jsonl"),
        error_file=str(run / "error.json"),
        checkpoints_dir=str(run / "checkpoints"),
        adapter_dir=str(run / "adapter"),
        merged_dir=str(run / "merged"),
        device="cpu" if tiny else "cuda:0",
        heartbeat_interval=2.0,
    )
    path = run / "spec.json"
    path.write_text(spec.to_json(), encoding="utf-8")
    return path


def child_wrapper(spec: Path, stats: Path) -> int:
    """The real child's ``main``, then the allocator's peaks (torch is imported by then)."""
    from qlora_supervise.trainer_child.__main__ import main

    code = main(["--spec", str(spec)])
    numbers: dict[str, Any] = {"exit_code": code}
    import torch

    if torch.cuda.is_available():
        s = torch.cuda.memory_stats()
        numbers |= {
            "max_allocated": torch.cuda.max_memory_allocated(),
            "max_reserved": torch.cuda.max_memory_reserved(),
            "alloc_retries": s.get("num_alloc_retries"),
            "device_total": torch.cuda.get_device_properties(0).total_memory,
        }
    stats.write_text(json.dumps(numbers), encoding="utf-8")
    return code


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def summarise(config: Config, run: Path, code: int, wall: float) -> dict[str, Any]:
    """What one child measured: peaks, memory after load, tokens/s, RSS."""
    events = read_jsonl(run / "events.jsonl")
    stats = json.loads((run / "stats.json").read_text()) if (run / "stats.json").is_file() else {}
    loaded = next((e for e in events if e.get("event") == "loaded"), {})
    started = next((e for e in events if e.get("event") == "started"), {})
    by_step: dict[int, float] = {}
    for e in events:
        if e.get("event") == "heartbeat" and e.get("tokens_per_s") and e.get("step"):
            by_step.setdefault(int(e["step"]), float(e["tokens_per_s"]))
    later = [v for s, v in sorted(by_step.items()) if s > 2] or list(by_step.values())
    # The child's memory fields (trainer_child/contract/ MemoryNumbers; older keys read too).
    from qlora_supervise.trainer_child.contract.events import MemoryNumbers

    at_load = MemoryNumbers.from_fields(loaded)
    rss = [m.rss_high_water_bytes for m in map(MemoryNumbers.from_fields, events) if m.rss_high_water_bytes]
    error = json.loads((run / "error.json").read_text()) if (run / "error.json").is_file() else None
    return {
        "config": dataclasses.asdict(config),
        "name": config.name,
        "exit_code": code,
        "wall_s": round(wall, 1),
        "max_allocated": stats.get("max_allocated"),
        "max_reserved": stats.get("max_reserved"),
        "alloc_retries": stats.get("alloc_retries"),
        "loaded_allocated": at_load.allocated_bytes,
        "loaded_peak": at_load.peak_bytes,
        "loaded_reserved": at_load.reserved_bytes,
        "trainable_params": loaded.get("trainable_params"),
        "attn_implementation": loaded.get("attn_implementation"),
        "vmdata_after_imports": started.get("vmdata"),
        "peak_rss": max(rss) if rss else None,
        "tokens_per_s": round(statistics.median(later), 1) if later else None,
        "tokens_per_s_steps": {str(k): round(v, 1) for k, v in sorted(by_step.items())},
        "error": None if error is None else f"{error.get('stage')}: {error.get('message', '')[:300]}",
    }


# --------------------------------------------------------------------------- prediction


def predicted(config: Config, work: Path) -> dict[str, Any] | None:
    """The memory model's numbers for ``config`` (None when the model dir is not there yet)."""
    from qlora_supervise.policies import memory_model

    path = work / config.shape / "model" / "config.json"
    if not path.is_file():
        return None
    shape = memory_model.ModelShape.from_config(json.loads(path.read_text()))
    if shape is None:
        return None
    prediction = memory_model.predict(shape, config.knobs(), targets=config.target_modules)
    return {"peak_allocated": prediction.peak_bytes, "components": dict(prediction.components)}


def admit_size(config: Config, work: Path) -> int:
    guess = predicted(config, work)
    return int(guess["peak_allocated"] * 1.05) + GiB if guess else 40 * GiB


def gpu_total() -> int:
    try:
        import pynvml

        pynvml.nvmlInit()
        total = int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
        pynvml.nvmlShutdown()
        return total
    except Exception:
        return 140 * GiB


# --------------------------------------------------------------------------- running


@dataclasses.dataclass
class Running:
    config: Config
    run: Path
    proc: subprocess.Popen[bytes]
    started: float
    size: int


def launch(config: Config, work: Path, index: int, tiny: bool) -> tuple[Path, subprocess.Popen[bytes]]:
    run = work / "runs" / f"{index:02d}"
    shutil.rmtree(run, ignore_errors=True)
    run.mkdir(parents=True)
    spec = write_spec(config, work, run, tiny)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="2")
    argv = [*module_argv(__spec__), "--_child", str(spec), "--out", str(run)]
    with (run / "child.log").open("wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    return run, proc


def run_configs(
    configs: list[Config], work: Path, parallel: int, deadline: float, tiny: bool, save: Any
) -> list[dict[str, Any]]:
    """Run every config in its own process, ``parallel`` at a time within the card's memory.

    Largest first, so the big ones do not wait for the end; a config that ran out of memory next
    to others is tried again alone if time is left (its number would otherwise be lost).
    """
    total = gpu_total()
    queue = sorted(enumerate(configs), key=lambda ic: -admit_size(ic[1], work))
    retry: list[tuple[int, Config]] = []
    running: list[Running] = []
    results: list[dict[str, Any]] = []
    while queue or running or retry:
        if not queue and not running and retry:
            queue, retry = retry, []
            parallel = 1
        used = sum(r.size for r in running)
        while queue and len(running) < parallel and time.monotonic() < deadline:
            index, config = queue[0]
            size = admit_size(config, work)
            if running and used + size > total * 0.92:
                break
            queue.pop(0)
            run, proc = launch(config, work, index, tiny)
            running.append(Running(config, run, proc, time.monotonic(), size))
            used += size
        if time.monotonic() >= deadline:
            queue, retry = [], []
            for r in running:
                if time.monotonic() > deadline + 30:
                    r.proc.kill()
        time.sleep(1.0)
        for r in list(running):
            code = r.proc.poll()
            if code is None:
                continue
            running.remove(r)
            result = summarise(r.config, r.run, code, time.monotonic() - r.started)
            result["alongside"] = len(running)
            result["predicted"] = predicted(r.config, work)
            if code != 0 and parallel > 1 and result["error"] and "memory" in result["error"].lower():
                retry.append((configs.index(r.config), r.config))
                result["retried_alone"] = True
            results.append(result)
            print(f"  done {r.config.name}: exit {code}, {fmt(result['max_allocated'])} GiB", flush=True)
            save(results)
    return results


# --------------------------------------------------------------------------- the table


def fmt(value: Any) -> str:
    return "-" if not value else f"{int(value) / GiB:.2f}"


def table(results: list[dict[str, Any]]) -> list[str]:
    rows, errors = [], []
    for r in sorted(results, key=lambda x: x["name"]):
        pred = (r.get("predicted") or {}).get("peak_allocated")
        meas = r.get("max_allocated")
        err = (pred - meas) / meas if pred and meas and r["exit_code"] == 0 else None
        if err is not None:
            errors.append(abs(err))
        rows.append(
            (
                r["name"],
                fmt(meas),
                fmt(r.get("max_reserved")),
                fmt(pred),
                "-" if err is None else f"{err:+.1%}",
                fmt(r.get("loaded_allocated")),
                str(r.get("tokens_per_s") or "-"),
                fmt(r.get("peak_rss")),
                str(r["exit_code"]),
            )
        )
    cols = ("config", "meas_alloc", "meas_rsv", "pred_alloc", "error", "loaded", "tok/s", "rss", "exit")
    widths = [max(len(c), *(len(x[i]) for x in rows)) if rows else len(c) for i, c in enumerate(cols)]
    line = "  ".join(f"{{:<{w}}}" for w in widths)
    out = [line.format(*cols), line.format(*("-" * w for w in widths)), *(line.format(*x) for x in rows)]
    if errors:
        out.append(
            f"{len(errors)} points: median |error| {statistics.median(errors):.1%}, "
            f"worst {max(errors):.1%} (GiB)"
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/memory_grid"))
    p.add_argument("--set", choices=("grid", "rungs", "both", "families"), default="grid")
    p.add_argument("--parallel", type=int, default=5)
    p.add_argument("--deadline-s", type=float, default=500.0)
    p.add_argument("--tiny", action="store_true", help="CPU check of this script with tiny shapes")
    p.add_argument("--max-seq", type=int, default=8192)
    p.add_argument("--_build", help=argparse.SUPPRESS)
    p.add_argument("--_child", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args._child:
        return child_wrapper(args._child, args.out / "stats.json")
    shapes = TINY_SHAPES if args.tiny else SHAPES
    if args._build:
        info = build_assets(
            args.work / args._build, shapes[args._build], "cpu" if args.tiny else "cuda", 64, args.max_seq
        )
        print("BUILD " + json.dumps(info), flush=True)
        return 0

    start = time.monotonic()
    deadline = start + args.deadline_s
    args.out.mkdir(parents=True, exist_ok=True)
    sets = {"grid": grid(), "rungs": [], "both": grid(), "families": family_grid()}
    tiny_sets = {"families": tiny_family_grid()}
    configs = tiny_sets.get(args.set, tiny_grid()) if args.tiny else sets[args.set]
    rungs = rung_set() if args.set in ("rungs", "both") and not args.tiny else []
    needed = sorted({c.shape for c in configs + rungs})
    report: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "tiny": args.tiny}
    report["build"] = build_all(
        needed, args.work, args.tiny, min(args.max_seq, 512) if args.tiny else args.max_seq
    )
    report["build_s"] = round(time.monotonic() - start, 1)
    print("build:", json.dumps(report["build"]), flush=True)
    report["plan"] = plan_outputs(needed, args.work)
    path = args.out / "memory-grid.json"

    def save(results: list[dict[str, Any]], key: str = "grid") -> None:
        report[key] = results
        path.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")

    save([])
    if configs:
        run_configs(configs, args.work, args.parallel, deadline, args.tiny, save)
    if rungs:
        run_configs(rungs, args.work, 1, deadline, args.tiny, lambda r: save(r, "rungs"))
    report["total_s"] = round(time.monotonic() - start, 1)
    save(report.get("grid", []))
    lines = ["== grid ==", *table(report.get("grid", []))]
    if rungs:
        lines += ["== rung costs (7B, alone on the GPU) ==", *table(report.get("rungs", []))]
    lines.append(f"total {report['total_s']} s")
    (args.out / "table.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print("\n".join(lines), flush=True)
    return 0


def plan_outputs(names: list[str], work: Path) -> dict[str, Any]:
    """``qlora-supervise plan``'s shape reading on the real files (config + safetensors index)."""
    from qlora_supervise.supervisor.jobfile import model_files

    found: dict[str, Any] = {}
    for name in names:
        try:
            files = model_files.read_model_files(work / name / "model")
            found[name] = {"tensors": len(files.tensors), "bytes_16bit": files.checkpoint_bytes}
        except Exception as error:  # a bench records what went wrong and goes on
            found[name] = {"error": repr(error)}
    return found


if __name__ == "__main__":
    sys.exit(main())
