"""What each model family keeps resident and saves for backward in the child's QLoRA forward (CPU).

    python -m bench.models.family_memory_cpu [--families llama gemma2 ...] [--out DIR] [--threads 2]

For each family a random-weight model with the real block widths of a released model, two decoder
layers and (where the real one would make the CPU run slow) a 32768-token vocabulary, is saved in
bf16 and loaded by the trainer child's own recipe (``trainer_child.recipe.qlora.build``: NF4 +
double quant, bf16 compute, ``prepare_model_for_kbit_training``, LoRA by the targets table, trl
1.16's SFTTrainer, which casts the adapter to bf16 and adds its fused LM head). Then, per point
(micro-batch, seq_len, checkpointing, targets), one training forward (``trainer.compute_loss``)
runs under ``torch.autocast("cpu", bfloat16)``, which stands in for the GPU's bf16 autocast (the
child on a GPU sets ``bf16=True``; on the CPU it would run fp32), and records:

* **resident bytes** by group: 4-bit weights (packed data + quant state), every other parameter by
  dtype and name group (embeddings, LM head, norms, MoE experts, router, other), the adapter;
* **saved bytes**: every tensor autograd saves (``saved_tensors_hooks``), each storage once, by the
  module that was running when it was saved (forward pre/post hooks), the fused head's
  ``ChunkedLogProbFunction`` singled out; with checkpointing, the decoder layers' inputs, which the
  non-reentrant checkpoint keeps outside the saved-tensor hooks;
* for one point per family, each saved tensor of the decoder layers with the autograd node and
  attribute that saved it (a walk of the graph's ``_saved_*`` attributes).

Two deliberate departures from the CPU path, so the numbers are the GPU's (README beside the results):
trl scores only the labelled positions (``hidden[mask]``) where Triton exists and flattens all of
them elsewhere; the bench takes the GPU branch (one variant per family measures the CPU's too), and the
forward runs under bf16 autocast. Not a test; writes ``family-memory.json`` and ``table.txt``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .._launch import module_argv

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["CUDA_VISIBLE_DEVICES"] = ""  # a CPU bench, even on a machine with a GPU

# torch after the environment above, which the libraries read at import
import torch

RESULTS = Path(__file__).resolve().parents[1] / "results" / "family-memory-cpu-2026-12-02"
#: Smaller than every real vocabulary of these families but Phi-3's (kept at its real 32064):
#: the head's saved bytes do not depend on it; its resident bytes scale with it (JSON records both).
VOCAB = 32768


@dataclasses.dataclass(frozen=True)
class FamilyShape:
    """One family's stand-in: the ``config.json`` widths of ``source``, two layers, ``vocab`` tokens."""

    key: str
    model_type: str
    source: str
    real_vocab: int
    vocab: int
    config: dict[str, Any]
    #: sequence lengths measured (Gemma 2 adds 1024: its eager attention grows with seq²)
    seqs: tuple[int, ...] = (256, 512)
    #: (targets, checkpointing) of each build; the all-linear build is measured at seq 512 only
    builds: tuple[tuple[str, bool], ...] = (("attention", False), ("attention", True), ("all-linear", False))


# Widths as published in each model's config.json (hidden, intermediate, heads, kv heads,
# head_dim, vocab, tie, family specifics); two layers so the CPU can run them.
SHAPES: tuple[FamilyShape, ...] = (
    FamilyShape(
        "llama",
        "llama",
        "meta-llama/Llama-3.2-1B",
        128256,
        VOCAB,
        dict(
            hidden_size=2048,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=64,
            tie_word_embeddings=True,
            rope_theta=500000.0,
        ),
    ),
    FamilyShape(
        "qwen3",
        "qwen3",
        "Qwen/Qwen3-1.7B",
        151936,
        VOCAB,
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            tie_word_embeddings=True,
        ),
    ),
    FamilyShape(
        "gemma2",
        "gemma2",
        "google/gemma-2-2b",
        256000,
        VOCAB,
        dict(
            hidden_size=2304,
            intermediate_size=9216,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=4096,
            attn_logit_softcapping=50.0,
            final_logit_softcapping=30.0,
            tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention"],
        ),
        seqs=(256, 512, 1024),
    ),
    FamilyShape(
        "gemma3_text",
        "gemma3_text",
        "google/gemma-3-1b-pt",
        262144,
        VOCAB,
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            tie_word_embeddings=True,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    # Gemma 3 with both layers sliding: does each sliding layer save its own copy of the mask? (It does.)
    FamilyShape(
        "gemma3_text_2sliding",
        "gemma3_text",
        "google/gemma-3-1b-pt, both layers sliding_attention",
        262144,
        VOCAB,
        dict(
            hidden_size=1152,
            intermediate_size=6912,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=512,
            tie_word_embeddings=True,
            layer_types=["sliding_attention", "sliding_attention"],
        ),
        seqs=(256, 512, 1024),
        builds=(("attention", False),),
    ),
    FamilyShape(
        "phi3",
        "phi3",
        "microsoft/Phi-3-mini-4k-instruct",
        32064,
        32064,
        dict(
            hidden_size=3072,
            intermediate_size=8192,
            num_attention_heads=32,
            num_key_value_heads=32,
            tie_word_embeddings=False,
        ),
    ),
    FamilyShape(
        "qwen3_moe",
        "qwen3_moe",
        "Qwen/Qwen3-30B-A3B (128 experts, top-8; here 8 experts, top-2)",
        151936,
        VOCAB,
        dict(
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=8,
            num_experts_per_tok=2,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            router_aux_loss_coef=0.001,
            tie_word_embeddings=False,
        ),
    ),
)
MICRO_BATCHES = (1, 2)
LAYERS = 2


# ---- the model and the child's recipe --------------------------------------------------------------
def write_model(shape: FamilyShape, directory: Path) -> Path:
    """Random bf16 weights of ``shape`` with the tiny tokenizer and data beside them (the child reads
    both); returns the model directory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from qlora_supervise.trainer_child.recipe.tiny import build_tokenizer, tiny_rows

    rows = tiny_rows()
    with (directory / "data.jsonl").open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    torch.manual_seed(0)
    ids = {"vocab_size": shape.vocab, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3}
    config = AutoConfig.for_model(
        shape.model_type, num_hidden_layers=LAYERS, max_position_embeddings=4096, **ids, **shape.config
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)  # type: ignore[no-untyped-call]
    model_dir = directory / "model"
    model.save_pretrained(model_dir)
    build_tokenizer(rows).save_pretrained(model_dir)
    return model_dir


def attempt_spec(model_dir: Path, run_dir: Path, targets: str, checkpointing: bool) -> Any:
    """The child's attempt spec for this model; bf16 compute, as ``auto`` picks on a bf16 GPU."""
    from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DataSpec, Knobs, TrainSpec

    knobs = Knobs(
        model=str(model_dir),
        micro_batch_size=1,
        grad_accum=1,
        max_seq_len=256,
        gradient_checkpointing=checkpointing,
    )
    train = TrainSpec(
        max_steps=1,
        save_steps=100,
        logging_steps=1,
        warmup_ratio=0.0,
        target_modules=targets,
        compute_dtype="bf16",
    )
    return AttemptSpec(
        attempt=1, run_dir=str(run_dir), knobs=knobs,
        data=DataSpec(path=str(model_dir.parent / "data.jsonl")), train=train,
        events_file=str(run_dir / "events.jsonl"), error_file=str(run_dir / "error.json"),
        checkpoints_dir=str(run_dir / "checkpoints"), adapter_dir=str(run_dir / "adapter"),
        merged_dir=str(run_dir / "merged"), device="cpu",
    )  # fmt: skip


def build_trainer(spec: Any) -> Any:
    """The child's own build (load, prepare, LoRA, SFTTrainer) on the CPU."""
    from qlora_supervise.trainer_child.contract.checkpoints import ResumeSource
    from qlora_supervise.trainer_child.recipe import qlora
    from qlora_supervise.trainer_child.run.heartbeat import EventLog, Progress

    return qlora.build(spec, Progress(EventLog(spec.events_file)), False, ResumeSource())


# ---- resident bytes --------------------------------------------------------------------------------
def param_group(name: str) -> str:
    """The name group of a parameter that is not 4-bit (``base_model.model.`` prefixes stripped)."""
    leaf = name.rsplit(".", 2)
    if "lora_" in name:
        return "adapter"
    if "embed_tokens" in name:
        return "embeddings"
    if "lm_head" in name:
        return "lm_head"
    if "norm" in name:
        return "norms"
    if ".experts." in name:
        return "moe_experts"
    if len(leaf) >= 2 and leaf[-2] == "gate":  # Qwen3-MoE's router: mlp.gate.weight
        return "moe_router"
    return "other"


def quant_state_bytes(state: Any) -> dict[str, int]:
    """The bytes of a bitsandbytes QuantState's tensors (absmax, code; the nested state's too)."""
    out: dict[str, int] = {}
    for field in ("absmax", "code", "offset"):
        value = getattr(state, field, None)
        if isinstance(value, torch.Tensor):
            out[field] = value.untyped_storage().nbytes()
    nested = getattr(state, "state2", None)
    if nested is not None:
        for field, size in quant_state_bytes(nested).items():
            out[f"state2.{field}"] = size
    return out


def resident(model: Any) -> dict[str, Any]:
    """Resident parameter bytes by group and dtype, tied parameters once (``named_parameters``
    dedupes them); the LM head reports tied when it shares the embeddings' storage."""
    from bitsandbytes.nn import Params4bit

    four_bit: dict[str, Any] = {"weights": 0, "packed_data": 0, "quant_state": 0, "numel": 0}
    fields: dict[str, int] = {}
    groups: dict[str, dict[str, int]] = {}
    details: dict[str, list[str]] = {}
    for name, param in model.named_parameters():
        if isinstance(param, Params4bit):
            four_bit["weights"] += 1
            four_bit["packed_data"] += param.untyped_storage().nbytes()
            four_bit["numel"] += int(param.quant_state.shape.numel())
            for field, size in quant_state_bytes(param.quant_state).items():
                four_bit["quant_state"] += size
                fields[field] = fields.get(field, 0) + size
            continue
        group = param_group(name)
        by_dtype = groups.setdefault(group, {})
        dtype = str(param.dtype).removeprefix("torch.")
        by_dtype[dtype] = by_dtype.get(dtype, 0) + param.untyped_storage().nbytes()
        entry = (
            f"{name.removeprefix('base_model.model.')} {list(param.shape)} {dtype} grad={param.requires_grad}"
        )
        details.setdefault(group, []).append(entry)
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = (
        head is not None
        and head.weight.untyped_storage().data_ptr() == embed.weight.untyped_storage().data_ptr()
    )
    buffers = sum(b.untyped_storage().nbytes() for b in model.buffers())
    per_weight = (four_bit["packed_data"] + four_bit["quant_state"]) / max(four_bit["numel"], 1)
    four_bit.update(quant_state_fields=fields, bytes_per_weight=per_weight)
    return {
        "four_bit": four_bit,
        "groups": groups,
        "tied_head": tied,
        "buffers": buffers,
        "parameters": details,
    }


# ---- saved tensors ---------------------------------------------------------------------------------
@dataclasses.dataclass
class Saved:
    """One storage autograd saved: where first, its size, and what else saved a view of it."""

    nbytes: int
    shape: list[int]
    dtype: str
    module: str
    order: int
    param: str | None
    also: set[str] = dataclasses.field(default_factory=set)
    saved_by: set[str] = dataclasses.field(default_factory=set)


class Ledger:
    """The forward's saved storages, keyed by storage pointer, attributed to the innermost running
    module (a stack kept by forward hooks on every module of the base model)."""

    def __init__(self, model: Any) -> None:
        self.stack: list[str] = ["other"]
        self.saved: dict[int, Saved] = {}
        self.kept: dict[int, Saved] = {}  # checkpointing: the layers' inputs
        self.recording_inputs = False
        self.params = {
            p.untyped_storage().data_ptr(): n.removeprefix("base_model.model.")
            for n, p in model.named_parameters()
        }
        self.handles: list[Any] = []
        for name, module in model.get_base_model().named_modules():
            if name:
                self.handles.append(module.register_forward_pre_hook(self._enter(name)))
                self.handles.append(module.register_forward_hook(self._leave(name), always_call=True))
        for index, layer in enumerate(model.get_base_model().model.layers):
            self.handles.append(layer.register_forward_pre_hook(self._inputs(index), with_kwargs=True))

    def _enter(self, name: str) -> Any:
        def hook(module: Any, args: Any) -> None:
            self.stack.append(name)

        return hook

    def _leave(self, name: str) -> Any:
        def hook(module: Any, args: Any, output: Any) -> None:
            if self.stack[-1] == name:
                self.stack.pop()

        return hook

    def _inputs(self, index: int) -> Any:
        def hook(module: Any, args: Any, kwargs: Any) -> None:
            if not self.recording_inputs:
                return
            for key, value in [*enumerate(args), *kwargs.items()]:
                for tensor in value if isinstance(value, tuple) else (value,):
                    if isinstance(tensor, torch.Tensor):
                        self._note(self.kept, tensor, f"model.layers.{index}.<input {key}>")

        return hook

    def _note(self, table: dict[int, Saved], tensor: torch.Tensor, module: str) -> None:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in table:
            if table[ptr].module != module:
                table[ptr].also.add(module)
            return
        dtype = str(tensor.dtype).removeprefix("torch.")
        table[ptr] = Saved(
            storage.nbytes(), list(tensor.shape), dtype, module, len(table), self.params.get(ptr)
        )

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self._note(self.saved, tensor, self.stack[-1])
        return tensor

    @contextlib.contextmanager
    def head(self) -> Iterator[None]:
        self.stack.append("lm_head.fused")
        try:
            yield
        finally:
            self.stack.pop()

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


@contextlib.contextmanager
def labelled_head(ledger: Ledger, gpu_branch: bool) -> Iterator[None]:
    """While inside: trl's fused head runs under the ledger's ``lm_head.fused`` label, and takes
    its GPU branch (labelled positions only, ``hidden[mask]``) when ``gpu_branch``."""
    # trl's private names (1.16): typed Any, as they are not exported
    utils: Any = importlib.import_module("trl.trainer.utils")
    original_function, original_triton = utils._ChunkedLogProbFunction, utils._use_triton

    class Labelled:
        @staticmethod
        def apply(*args: Any) -> Any:
            with ledger.head():
                return original_function.apply(*args)

    utils._ChunkedLogProbFunction = Labelled
    if gpu_branch:
        # Only add_fused_lm_head's own choice of branch; the kernel module keeps its torch tile ops.
        utils._use_triton = lambda device: True
    try:
        yield
    finally:
        utils._ChunkedLogProbFunction, utils._use_triton = original_function, original_triton


def walk_saved(root: Any) -> dict[int, set[str]]:
    """Storage pointer -> the ``Node._saved_attr`` names that hold it, over the whole graph from
    ``root`` (only without checkpointing: reading a checkpointed node's saved tensor recomputes)."""
    found: dict[int, set[str]] = {}
    seen: set[int] = set()
    todo = [root]
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        todo.extend(next_node for next_node, _ in node.next_functions)
        for attr, value in saved_values(node):
            for tensor in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(tensor, torch.Tensor):
                    found.setdefault(tensor.untyped_storage().data_ptr(), set()).add(f"{node.name()}.{attr}")
    return found


def saved_values(node: Any) -> list[tuple[str, Any]]:
    """A node's saved tensors: the ``_saved_*`` attributes of built-in nodes, ``saved_tensors`` of
    a custom Function's."""
    values: list[tuple[str, Any]] = []
    for attr in dir(node):
        if attr.startswith("_saved_"):
            with contextlib.suppress(RuntimeError):
                values.append((attr.removeprefix("_saved_"), getattr(node, attr)))
    if hasattr(node, "saved_tensors"):
        with contextlib.suppress(RuntimeError):
            values.append(("saved_tensors", node.saved_tensors))
    return values


# ---- one point -------------------------------------------------------------------------------------
def batch(trainer: Any, micro: int, seq: int) -> dict[str, torch.Tensor]:
    """A full-length batch with the keys the child's collator gives (every position labelled)."""
    generator = torch.Generator().manual_seed(micro * 100003 + seq)
    vocab = trainer.model.get_input_embeddings().weight.shape[0]
    ids = torch.randint(4, vocab, (micro, seq), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def group_of(module: str) -> str:
    """``model.layers.1.mlp.down_proj`` -> ``layer.1``; the final norm, the head, the rest."""
    parts = module.split(".")
    if module.startswith("model.layers."):
        return f"layer.{parts[2]}"
    if module in ("model.norm", "lm_head.fused"):
        return {"model.norm": "final_norm", "lm_head.fused": "lm_head_fused"}[module]
    if module.startswith("model.embed_tokens"):
        return "embeddings"
    return "other"


def totals(table: dict[int, Saved]) -> dict[str, dict[str, int]]:
    """Bytes by group, activations and (separately) parameters that were saved."""
    out: dict[str, dict[str, int]] = {"activations": {}, "parameters": {}}
    for item in table.values():
        kind = "parameters" if item.param else "activations"
        group = group_of(item.module)
        out[kind][group] = out[kind].get(group, 0) + item.nbytes
    return out


def tensor_rows(table: dict[int, Saved], tokens: int) -> list[dict[str, Any]]:
    """Each saved storage in forward order, for the per-tensor breakdown."""
    rows = []
    for item in sorted(table.values(), key=lambda saved: saved.order):
        rows.append({
            "module": item.module, "group": group_of(item.module), "shape": item.shape, "dtype": item.dtype,
            "bytes": item.nbytes, "bytes_per_token": item.nbytes / tokens, "param": item.param,
            "saved_by": sorted(item.saved_by), "also_saved_in": sorted(item.also),
        })  # fmt: skip
    return rows


def measure(
    trainer: Any, micro: int, seq: int, *, autocast: bool, gpu_head: bool, breakdown: bool
) -> dict[str, Any]:
    """One training forward (the loss included) under the ledger; the graph is dropped after."""
    from qlora_supervise.trainer_child.recipe.activations import set_checkpointing

    model = trainer.model
    checkpointing = bool(trainer.args.gradient_checkpointing)
    set_checkpointing(trainer, checkpointing)  # as Trainer.train would, with the child's kwargs
    model.train()
    ledger = Ledger(model)
    inputs = batch(trainer, micro, seq)
    started = time.monotonic()
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    try:
        with (
            cast,
            labelled_head(ledger, gpu_head),
            torch.autograd.graph.saved_tensors_hooks(ledger.pack, lambda t: t),
        ):
            ledger.recording_inputs = checkpointing
            loss = trainer.compute_loss(model, inputs)
            ledger.recording_inputs = False
        if breakdown and not checkpointing:
            for ptr, names in walk_saved(loss.grad_fn).items():
                if ptr in ledger.saved:
                    ledger.saved[ptr].saved_by |= names
    finally:
        ledger.close()
    seconds = time.monotonic() - started
    tokens = micro * seq
    kept = {k: v for k, v in ledger.kept.items() if k not in ledger.saved}  # not saved by an op as well
    point: dict[str, Any] = {
        "micro_batch": micro, "seq_len": seq, "tokens": tokens, "gradient_checkpointing": checkpointing,
        "autocast_bf16": autocast, "head_branch": "gpu (hidden[mask])" if gpu_head else "cpu (all positions)",
        "loss": float(loss), "forward_s": round(seconds, 2), "saved": totals(ledger.saved),
        "checkpoint_kept_inputs": totals(kept)["activations"] if checkpointing else {},
        "checkpoint_kept_tensors": tensor_rows(kept, tokens) if checkpointing else [],
    }  # fmt: skip
    if breakdown:
        point["tensors"] = tensor_rows(ledger.saved, tokens)
    del loss, ledger
    gc.collect()
    return point


# ---- the run ---------------------------------------------------------------------------------------
def family_points(shape: FamilyShape, root: Path) -> dict[str, Any]:
    """Build the family once per (targets, checkpointing), as the child would, and measure its points:
    ``attention`` over the whole grid, ``all-linear`` (checkpointing off) at seq 512."""
    model_dir = write_model(shape, root)
    out: dict[str, Any] = {"shape": dataclasses.asdict(shape), "builds": []}
    for targets, checkpointing in shape.builds:
        trainer = build_trainer(
            attempt_spec(model_dir, root / f"run-{targets}-{int(checkpointing)}", targets, checkpointing)
        )
        model = trainer.model
        build: dict[str, Any] = {
            "targets": targets, "gradient_checkpointing": checkpointing,
            "attn_implementation": model.config._attn_implementation,
            "lora_targets": sorted(model.peft_config["default"].target_modules),
            "checkpointing_kwargs": trainer.args.gradient_checkpointing_kwargs,
            "resident": resident(model), "points": [],
        }  # fmt: skip
        for seq in shape.seqs if targets == "attention" else (512,):
            for micro in MICRO_BATCHES:
                for variant in variants(targets, checkpointing, micro, seq):
                    point = measure(trainer, micro, seq, **variant)
                    build["points"].append(point)
                    print(row(shape.key, build, point), flush=True)
        out["builds"].append(build)
        del trainer, model
        gc.collect()
    return out


def variants(targets: str, checkpointing: bool, micro: int, seq: int) -> list[dict[str, bool]]:
    """The measurement(s) of one point: bf16 autocast and trl's GPU head branch; at b=1, seq 512 of
    the attention build (not 256, which is Gemma's head_dim: the shapes would not tell q from
    scores), the per-tensor breakdown too, and without checkpointing the two variants (no
    autocast; trl's CPU head branch)."""
    first = targets == "attention" and micro == 1 and seq == 512
    main = {"autocast": True, "gpu_head": True, "breakdown": first}
    if not first or checkpointing:
        return [main]
    return [main, {"autocast": False, "gpu_head": True, "breakdown": True},
            {"autocast": True, "gpu_head": False, "breakdown": True}]  # fmt: skip


HEADER = (
    f"{'family':<20} {'targets':<10} {'b':>2} {'seq':>5} {'gc':>3} {'ac':>3} {'head':>4} "
    f"{'L0 B/tok':>9} {'L1 B/tok':>9} {'norm':>6} {'lmhd':>6} {'other':>6} {'kept':>7} {'total MiB':>10}"
)


def row(family: str, build: dict[str, Any], point: dict[str, Any]) -> str:
    """One table line: per-token saved activation bytes by group (gc: the kept inputs too)."""
    acts = point["saved"]["activations"]
    tokens = point["tokens"]

    def per(group: str) -> str:
        return f"{acts.get(group, 0) / tokens:.0f}"

    kept = sum(point["checkpoint_kept_inputs"].values())
    total = sum(acts.values()) + kept
    return (
        f"{family:<20} {build['targets']:<10} {point['micro_batch']:>2} {point['seq_len']:>5} "
        f"{'on' if point['gradient_checkpointing'] else 'off':>3} "
        f"{'y' if point['autocast_bf16'] else 'n':>3} {point['head_branch'][:3]:>4} "
        f"{per('layer.0'):>9} {per('layer.1'):>9} {per('final_norm'):>6} {per('lm_head_fused'):>6} "
        f"{(acts.get('other', 0) + acts.get('embeddings', 0)) / tokens:>6.0f} {kept / tokens:>7.0f} "
        f"{total / 2**20:>10.2f}"
    )


def versions() -> dict[str, str]:
    from qlora_supervise.trainer_child.recipe.stack import import_training_stack

    found: dict[str, str] = import_training_stack()
    return found


def measure_family(key: str, threads: int) -> dict[str, Any]:
    """One family in a fresh process (``--one``), as the child is one process per attempt; it also
    keeps the three builds' models from piling up in one process (a single process grew past the
    machine's 23 GiB over seven families)."""
    with tempfile.TemporaryDirectory(prefix=f"family-{key}-") as root:
        out = Path(root) / "family.json"
        command = [*module_argv(__spec__), "--one", key, "--to", str(out), "--threads", str(threads)]
        subprocess.run(command, check=True)
        family: dict[str, Any] = json.loads(out.read_text(encoding="utf-8"))
        return family


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--families", nargs="*", default=[shape.key for shape in SHAPES])
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # the per-family process
    parser.add_argument("--to", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)  # a shared 2-core machine
    if args.one:
        shape = next(shape for shape in SHAPES if shape.key == args.one)
        with tempfile.TemporaryDirectory(prefix=f"family-{shape.key}-") as root:
            family = family_points(shape, Path(root))
        args.to.write_text(json.dumps(family) + "\n", encoding="utf-8")
        return 0
    started = time.monotonic()
    print(HEADER, flush=True)
    families = {
        shape.key: measure_family(shape.key, args.threads) for shape in SHAPES if shape.key in args.families
    }
    record = {
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "versions": versions(),
        "threads": args.threads,
        "wall_s": round(time.monotonic() - started, 1),
        "families": families,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "family-memory.json").write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    lines = [HEADER] + [
        row(key, build, point)
        for key, family in families.items()
        for build in family["builds"]
        for point in build["points"]
    ]
    (args.out / "table.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.out} in {record['wall_s']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
