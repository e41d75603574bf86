"""What the in-process QLoRA benches share: shapes, random-weight builds, the recipe's load, timing.

Self-contained on purpose: it depends on torch, transformers, peft, trl and bitsandbytes only, never
on ``qlora_supervise`` (whose modules are being moved), and copies the settings of the trainer
child's recipe (``trainer_child/recipe/``): NF4 + double quant + bf16 compute, ``use_cache=False``,
``prepare_model_for_kbit_training`` with non-reentrant checkpointing, LoRA on q/k/v/o with
alpha = 2r and dropout 0.05, trl's SFTTrainer with bf16 autocast, cosine schedule, warmup 0.03,
max_grad_norm 0.3, learning rate 2e-4, seed 42 (the TrainSpec defaults of 2026-12-01).

Run as a script only to build one random-weight model (``throughput_sweep.py`` and
``head_parity.py`` start it in a subprocess, so the measuring process never held the bf16 model):

    python -m bench.models._qlora_bench --build 8b-128k --dest /tmp/qb/8b-128k [--device cpu --tiny]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .._launch import module_argv

GiB = 1 << 30
QKVO = ["q_proj", "k_proj", "v_proj", "o_proj"]
#: The trainer child's TrainSpec defaults (trainer_child/contract/spec.py on 2026-12-01).
LEARNING_RATE = 2e-4
LR_SCHEDULER = "cosine"
WARMUP_RATIO = 0.03
MAX_GRAD_NORM = 0.3
LORA_DROPOUT = 0.05
SEED = 42
#: Ids below this are the tokenizer's specials (<pad> <unk> <s> </s>); data never uses them.
FIRST_ID = 4

SHAPES: dict[str, dict[str, Any]] = {
    # Llama-2-7B: multi-head attention, 32k vocabulary, untied.
    "7b-32k": dict(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
        tie_word_embeddings=False,
    ),
    # Llama-3-8B: grouped-query attention, 128k vocabulary, untied.
    "8b-128k": dict(
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        vocab_size=128256,
        tie_word_embeddings=False,
    ),
    # Llama-3.2-1B: grouped-query attention, 128k vocabulary, tied.
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
#: CPU stand-ins of the same structure, for checking the scripts' logic here; intermediate sizes
#: are multiples of 32 (bitsandbytes' CPU 4-bit path, as in trainer_child/recipe/tiny.py).
TINY_SHAPES: dict[str, dict[str, Any]] = {
    "7b-32k": dict(SHAPES["7b-32k"], hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, vocab_size=512),
    "8b-128k": dict(SHAPES["8b-128k"], hidden_size=128, intermediate_size=448, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=2048),
    "1b-128k": dict(SHAPES["1b-128k"], hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=2048),
}  # fmt: skip


# --------------------------------------------------------------------------- building


def build_model(shape: dict[str, Any], dest: Path, device: str) -> dict[str, Any]:
    """Random bf16 weights built on ``device`` and ``save_pretrained`` to ``dest``, with a
    specials-only tokenizer (the benches feed token ids, so it only has to name the pad token)."""
    import torch
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    t0 = time.monotonic()
    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama", pad_token_id=0, bos_token_id=2, eos_token_id=3, max_position_embeddings=8192, **shape
    )
    with torch.device(device):
        auto: Any = AutoModelForCausalLM  # from_config is unannotated
        model = auto.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(dest, max_shard_size="5GB")
    specials = {"<pad>": 0, "<unk>": 1, "<s>": 2, "</s>": 3}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab=specials, unk_token="<unk>")),
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
    )
    tokenizer.save_pretrained(dest)
    return {"params": params, "build_s": round(time.monotonic() - t0, 1)}


def build_all(names: list[str], work: Path, tiny: bool) -> dict[str, Any]:
    """Build the shapes that are not on disk yet, in parallel subprocesses (CPU-bound saves)."""
    procs: dict[str, subprocess.Popen[str]] = {}
    for name in names:
        if (work / name / "config.json").is_file():
            continue
        argv = [*module_argv(__spec__), "--build", name, "--dest", str(work / name)]
        argv += ["--device", "cpu", "--tiny"] if tiny else ["--device", "cuda"]
        procs[name] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    info: dict[str, Any] = {}
    for name, proc in procs.items():
        out, _ = proc.communicate()
        lines = [x for x in out.splitlines() if x.startswith("BUILD ")]
        info[name] = json.loads(lines[-1][6:]) if lines else {"error": out[-3000:]}
    return info


# --------------------------------------------------------------------------- the recipe


def on_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def load_4bit(path: Path) -> Any:
    """The recipe's load: NF4, double quant, bf16 compute, no KV cache, all on one device."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )
    return AutoModelForCausalLM.from_pretrained(
        path,
        quantization_config=quant,
        dtype=torch.bfloat16,
        use_cache=False,  # useless in training, and conflicts with checkpointing
        low_cpu_mem_usage=True,
        device_map={"": 0 if on_cuda() else "cpu"},
    )


def head_modules(model: Any) -> list[Any]:
    """The input embeddings and the LM head (one module when they are tied)."""
    found = [model.get_input_embeddings(), model.get_output_embeddings()]
    return [m for i, m in enumerate(found) if m is not None and all(m is not n for n in found[:i])]


def prepare(model: Any, head: str, checkpointing: bool) -> Any:
    """``prepare_model_for_kbit_training``; with ``head="bf16"`` the embeddings and LM head stay bf16.

    peft upcasts every non-4-bit parameter to fp32 in place. For the bf16 variant the embeddings and
    head sit on the host while it does (and are cast back to bf16 there), so the GPU never holds
    their fp32 copies (2.1 GB each at a 128k vocabulary): a card cap then sees what a planner that
    keeps them bf16 would see, not the transient of an upcast followed by a downcast. The values are
    the same either way (bf16 -> fp32 -> bf16 is exact). Norms stay fp32 in both variants.
    """
    import torch
    from peft import prepare_model_for_kbit_training

    parked = head_modules(model) if head == "bf16" else []
    device = next(p.device for p in model.parameters())
    for module in parked:
        module.to("cpu")
    model = prepare_model_for_kbit_training(
        model,
        use_gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
    )
    for module in parked:
        module.to(dtype=torch.bfloat16)
        module.to(device)
    return model


def add_lora(model: Any, r: int) -> Any:
    """LoRA on q/k/v/o, alpha 2r; seeded first, so two variants start from the same adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import set_seed

    set_seed(SEED)
    lora = LoraConfig(
        r=r,
        lora_alpha=2 * r,
        lora_dropout=LORA_DROPOUT,
        target_modules=QKVO,
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def set_checkpointing(peft_model: Any, enabled: bool) -> None:
    """Trainer only ever turns checkpointing on; a sweep that reuses the model must turn it off."""
    base = peft_model.get_base_model()
    if enabled:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        base.gradient_checkpointing_disable()


def checkpointing_active(peft_model: Any) -> bool | None:
    """Whether the layers really recompute (recorded per config: the toggle is ours, not Trainer's)."""
    return getattr(peft_model.get_base_model(), "is_gradient_checkpointing", None)


def unpatch_forward(peft_model: Any) -> None:
    """Drop the fused-LM-head forward that each SFTTrainer puts on the base model as an instance
    attribute, so trainers built one after another on one model do not stack wrappers."""
    base = peft_model.get_base_model()
    base.__dict__.pop("forward", None)


def sft_config(out: Path, micro: int, seq: int, optimizer: str, checkpointing: bool, steps: int) -> Any:
    """The recipe's SFTConfig for a bench run: accumulation 1 (one micro-step per optimizer step),
    a loss logged every step, no saves."""
    from trl import SFTConfig

    cuda = on_cuda()
    kwargs: dict[str, Any] = dict(
        output_dir=str(out),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=1,
        max_length=seq,
        packing=False,
        optim=optimizer,
        learning_rate=LEARNING_RATE,
        lr_scheduler_type=LR_SCHEDULER,
        max_grad_norm=MAX_GRAD_NORM,
        max_steps=steps,
        save_strategy="no",
        logging_steps=1,
        eval_strategy="no",
        seed=SEED,
        gradient_checkpointing=checkpointing,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=True,  # autocast, as the child on a bf16 GPU; on the CPU too, so both variants run there
        use_cpu=not cuda,
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        auto_find_batch_size=False,
    )
    # transformers 5.24 folds warmup_ratio into warmup_steps (a float < 1 is a ratio); the GPU has 5.17.
    fields = {f.name for f in dataclasses.fields(SFTConfig)}
    kwargs["warmup_ratio" if "warmup_ratio" in fields else "warmup_steps"] = WARMUP_RATIO
    return SFTConfig(**kwargs)


def trainer(model: Any, tokenizer: Any, args: Any, rows: Any, callback: Any) -> Any:
    """trl's SFTTrainer, keeping each micro-step's exact loss (the logged one may be rounded) and
    without the console printer (one dict per step would bury the table)."""
    from transformers import PrinterCallback
    from trl import SFTTrainer

    class LossKeepingTrainer(SFTTrainer):
        step_losses: list[Any]

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            loss = super().training_step(*args, **kwargs)  # type: ignore[no-untyped-call]  # trl: unannotated
            self.step_losses.append(loss.detach())  # read after training: no extra sync per step
            return loss

    made = LossKeepingTrainer(
        model=model, args=args, train_dataset=rows, processing_class=tokenizer, callbacks=[callback]
    )
    made.step_losses = []
    made.remove_callback(PrinterCallback)
    return made


# --------------------------------------------------------------------------- data


def random_rows(count: int, seq: int, vocab: int, seed: int) -> Any:
    """``count`` rows of exactly ``seq`` uniform random ids (no padding, every token in the loss)."""
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(FIRST_ID, vocab, (count, seq), generator=generator)
    return Dataset.from_dict({"input_ids": ids.tolist()})


def motif_rows(count: int, seq: int, vocab: int, seed: int) -> Any:
    """Rows that can be learnt: a random motif (16-128 ids from the first 5000) repeated to ``seq``.

    Uniform random ids would leave nothing to learn, and a loss that cannot move says little about
    whether two variants train alike."""
    import torch
    from datasets import Dataset

    generator = torch.Generator().manual_seed(seed)
    top = min(vocab, FIRST_ID + 5000)
    rows = []
    for _ in range(count):
        length = int(torch.randint(16, 129, (1,), generator=generator))
        motif = torch.randint(FIRST_ID, top, (length,), generator=generator)
        rows.append(motif.repeat(seq // length + 1)[:seq].tolist())
    return Dataset.from_dict({"input_ids": rows})


# --------------------------------------------------------------------------- timing and memory


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def make_clock() -> Any:
    """A TrainerCallback that times each optimizer step (synchronised) and keeps the logged losses.

    With accumulation 1 an optimizer step is one micro-step. ``interval`` (end of step k-1 to end
    of step k) is what a run sees per step: data, forward, backward, clipping, optimizer and the
    Trainer's logging; ``fwd_bwd`` (step begin to pre-optimizer) includes the gradient clipping.
    """
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self) -> None:
            self.phase = "setup"
            self.begin = self.pre_opt = self.last_end = 0.0
            self.fwd_bwd: list[float] = []
            self.optim: list[float] = []
            self.step: list[float] = []
            self.interval: list[float] = []
            self.logs: list[dict[str, float]] = []

        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            _sync()
            self.begin = time.perf_counter()
            self.phase = "forward/backward"

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            _sync()
            self.pre_opt = time.perf_counter()
            self.fwd_bwd.append(self.pre_opt - self.begin)
            self.phase = "optimizer"

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            _sync()
            self.optim.append(time.perf_counter() - self.pre_opt)

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            _sync()
            now = time.perf_counter()
            self.step.append(now - self.begin)
            if self.last_end:
                self.interval.append(now - self.last_end)
            self.last_end = now
            self.phase = "between steps"

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                self.logs.append({"step": state.global_step, **{k: float(v) for k, v in logs.items()}})

    return StepClock()


def median_after(values: list[float], skip: int) -> float | None:
    kept = values[skip:]
    return round(statistics.median(kept), 5) if kept else None


def free() -> None:
    """Everything the last config left: Python references, the allocator's cache, bnb's paged
    buffers (bitsandbytes keeps every paged optimizer buffer in a global list), the peak stats."""
    import torch

    gc.collect()
    try:
        from bitsandbytes.functional import GlobalPageManager

        manager: Any = GlobalPageManager  # get_instance is unannotated
        manager.get_instance().paged_tensors.clear()
    except (ImportError, AttributeError):  # another bitsandbytes layout: nothing to clear there
        pass
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def memory() -> dict[str, int | None]:
    import torch

    if not torch.cuda.is_available():
        return {"allocated": None, "max_allocated": None, "max_reserved": None}
    return {
        "allocated": torch.cuda.memory_allocated(),
        "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(),
    }


def weight_bytes(model: Any) -> dict[str, int]:
    """Bytes of the 4-bit weights (packed, as stored) and of everything else, and the element
    count the 4-bit weights stand for: what a fixed per-micro-step cost would scale with."""
    packed = other = quantized_elements = 0
    for p in model.parameters():
        size = p.numel() * p.element_size()
        if type(p).__name__ == "Params4bit":
            packed += size
            quantized_elements += 2 * p.numel()  # two 4-bit values per stored byte
        else:
            other += size
    return {
        "weights_4bit_bytes": packed,
        "other_param_bytes": other,
        "quantized_elements": quantized_elements,
    }


def environment() -> dict[str, Any]:
    import bitsandbytes
    import peft
    import torch
    import transformers
    import trl

    cuda = torch.cuda.is_available()
    return {
        "kind": "environment",
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "device_total": torch.cuda.get_device_properties(0).total_memory if cuda else None,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "trl": trl.__version__,
        "bitsandbytes": bitsandbytes.__version__,
    }


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a journal; a line cut off by a killed writer is skipped."""
    rows = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue
    return rows


class Journal:
    """JSON lines, flushed per record, so a command killed at its time limit still returns data."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps(record, default=str) + "\n")
            handle.flush()
            os.fsync(handle.fileno())


@contextmanager
def quiet() -> Iterator[None]:
    """transformers/trl warnings and dataset progress bars once per config would bury the table."""
    import warnings

    import datasets
    import transformers

    datasets.disable_progress_bars()
    hf_logging: Any = transformers.logging  # set_verbosity_error is unannotated
    hf_logging.set_verbosity_error()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def oom_text(exc: BaseException) -> str:
    return str(exc).split("\n")[0][:400]


def gib(value: int | None) -> str:
    return "-" if value is None else f"{value / GiB:.2f}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="build one random-weight model (used by the benches)")
    p.add_argument("--build", required=True, choices=sorted(SHAPES))
    p.add_argument("--dest", type=Path, required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args(argv)
    shape = (TINY_SHAPES if args.tiny else SHAPES)[args.build]
    print("BUILD " + json.dumps(build_model(shape, args.dest, args.device)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
