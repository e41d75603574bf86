"""The QLoRA recipe, top to bottom in the seeds' order: 4-bit config → load (use_cache off) → k-bit
prepare → LoRA → checks → data → SFTConfig → trainer. Every config object is built here."""

from __future__ import annotations

import dataclasses
import os
import time
from importlib.util import find_spec
from itertools import pairwise
from pathlib import Path
from typing import Any

import bitsandbytes as bnb
import torch
from huggingface_hub.errors import HFValidationError
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, set_seed
from trl import SFTConfig

from qlora_supervise.trainer_child.contract import checkpoints, codes
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, Knobs
from qlora_supervise.trainer_child.contract.targets import TargetsError, check, resolve
from qlora_supervise.trainer_child.recipe import activations, fsdp, head
from qlora_supervise.trainer_child.recipe.data import TEXT, Prepared, load_rows, load_tokenizer
from qlora_supervise.trainer_child.recipe.trainer import SupervisedSFTTrainer
from qlora_supervise.trainer_child.run import heartbeat, memory, torchrun
from qlora_supervise.trainer_child.run.failure import ConfigError

#: A LoRA that trains more than this share of the parameters is not what the job meant.
MAX_TRAINABLE_SHARE = 0.5
_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_DTYPES |= {str(dtype).removeprefix("torch."): dtype for dtype in _DTYPES.values()}  # and their full names


def compute_dtype(name: str, on_cuda: bool) -> torch.dtype:
    """``auto``: bf16 if the GPU has it, else fp16; fp32 on CPU (CPU autocast is bf16-only, slow sans AMX)."""
    if name != "auto":
        if name not in _DTYPES:
            raise ConfigError(f"compute_dtype {name!r}: expected auto or one of {sorted(_DTYPES)}")
        return _DTYPES[name]
    if not on_cuda:
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def quantization_config(knobs: Knobs, dtype: torch.dtype) -> BitsAndBytesConfig | None:
    if not knobs.load_in_4bit:
        return None
    if knobs.quant_type not in ("nf4", "fp4"):
        raise ConfigError(f"quant_type {knobs.quant_type!r}: expected nf4 or fp4")
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=knobs.quant_type,
        bnb_4bit_use_double_quant=knobs.double_quant,
        bnb_4bit_compute_dtype=dtype,
        **fsdp.storage(knobs, dtype),  # FSDP-QLoRA: the 4-bit codes in a dtype FSDP can shard
        llm_int8_enable_fp32_cpu_offload=knobs.cpu_offload,
    )


def placement(knobs: Knobs, gpu_limit: int | None, on_cuda: bool) -> dict[str, Any]:
    """device_map / max_memory: CPU offload is a no-op on the CPU; on a GPU the model goes to the
    current device (``cuda:LOCAL_RANK`` under torchrun: DDP keeps one whole replica per rank)."""
    if not on_cuda:
        return {"device_map": {"": "cpu"}}
    index = torch.cuda.current_device()
    if not knobs.cpu_offload:
        return {"device_map": {"": index}}
    total = torch.cuda.get_device_properties(index).total_memory
    # The weights may take about half of the allowed device memory: the rest is for activations.
    budget = int((gpu_limit or total) * 0.5)
    return {"device_map": "auto", "max_memory": {index: budget, "cpu": "1000GiB"}}


def load_model(spec: AttemptSpec, dtype: torch.dtype, on_cuda: bool) -> Any:
    knobs = spec.knobs
    if not Path(knobs.model).exists() and os.environ.get("HF_HUB_OFFLINE") == "1" and "/" not in knobs.model:
        raise ConfigError(f"model {knobs.model!r}: no such directory (and the hub is offline)")
    try:
        return AutoModelForCausalLM.from_pretrained(
            knobs.model,
            quantization_config=quantization_config(knobs, dtype),
            dtype=dtype,
            use_cache=False,  # the KV cache is useless in training and conflicts with checkpointing
            trust_remote_code=spec.train.trust_remote_code,
            low_cpu_mem_usage=True,
            **placement(knobs, spec.gpu_memory_limit, on_cuda),
        )
    except (OSError, HFValidationError) as exc:  # missing files, not a model dir, bad repo id
        raise ConfigError(f"model {knobs.model!r}: {exc}") from exc


def check_target_modules(model: Any, target_modules: tuple[str, ...] | str) -> None:
    """Every target must match a real layer (a typo would silently train nothing). ``attention`` /
    ``mlp`` / ``all-linear`` resolve by model type (:mod:`...contract.targets`); a regex is peft's."""
    linear = {  # leaf names of the linear layers (4-bit ones included): target_modules' vocabulary
        name.rsplit(".", 1)[-1]
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and not name.endswith("lm_head")
    }
    try:
        check(target_modules, model.config.model_type, linear)
    except TargetsError as exc:
        raise ConfigError(f"target_modules {target_modules!r} on {type(model).__name__}: {exc}") from exc


def add_lora(model: Any, knobs: Knobs, spec: AttemptSpec, dtype: torch.dtype | None = None) -> Any:
    # bf16_head: the embeddings and LM head skip the fp32 upcast (recipe/head.py says why); under
    # FSDP every non-4-bit parameter does (recipe/fsdp.py: one dtype for FSDP to shard).
    kept = fsdp.kept_16bit(model, knobs) or (head.head_parameters(model) if knobs.bf16_head else [])
    with head.kept_out_of_upcast(kept, dtype):
        model = prepare_model_for_kbit_training(
            model,
            use_gradient_checkpointing=knobs.gradient_checkpointing,
            gradient_checkpointing_kwargs=activations.checkpointing_kwargs(),
        )
    if knobs.bf16_head:
        head.match_head_input(model)
    targets = resolve(spec.train.target_modules, model.config.model_type)  # checked at load
    lora = LoraConfig(
        r=knobs.lora_r,
        lora_alpha=knobs.lora_alpha,
        lora_dropout=spec.train.lora_dropout,
        target_modules=targets if isinstance(targets, str) else list(targets),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, lora)


def trainable_share(model: Any) -> tuple[int, int, float]:
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    share = trainable / total if total else 0.0
    if trainable == 0 or share > MAX_TRAINABLE_SHARE:
        raise ConfigError(
            f"LoRA trains {trainable} of {total} parameters ({share:.1%}); expected more than 0 and at "
            f"most {MAX_TRAINABLE_SHARE:.0%}: check target_modules and r"
        )
    return trainable, total, share


def check_chat_template(tokenizer: Any) -> None:
    """Assistant-only loss needs ``{% generation %}`` markers in the chat template, or a training
    template trl ships for the model family: a ConfigError before anything trains."""
    from trl.chat_template_utils import get_training_chat_template

    try:
        get_training_chat_template(tokenizer)
    except ValueError as exc:  # trl: no training template for this chat template
        raise ConfigError(
            "messages_field: the tokenizer's chat template does not mark assistant output with "
            "{% generation %} ... {% endgeneration %}, and trl has no training template for it, so the "
            "user's turns cannot be left out of the loss. Add the markers to the template "
            "(tokenizer_config.json chat_template), or render the chats to a text_field yourself"
        ) from exc


def sft_config(
    spec: AttemptSpec,
    dtype: torch.dtype,
    on_cuda: bool,
    has_eval: bool,
    sharding: dict[str, Any] | None = None,
) -> SFTConfig:
    # Every SFTConfig argument the recipe sets, in one flat list: which spec field becomes which setting.
    knobs, train = spec.knobs, spec.train
    evaluating = has_eval and knobs.eval_enabled and train.eval_steps is not None
    # transformers 5.24 folds warmup_ratio into warmup_steps (a float < 1 is a ratio).
    ratio = "warmup_ratio" in {field.name for field in dataclasses.fields(SFTConfig)}
    kwargs: dict[str, Any] = dict(
        output_dir=spec.checkpoints_dir,
        per_device_train_batch_size=knobs.micro_batch_size,
        gradient_accumulation_steps=knobs.grad_accum,
        per_device_eval_batch_size=knobs.eval_batch_size,
        max_length=knobs.max_seq_len,
        packing=train.packing,
        dataset_text_field=TEXT,
        # Chat: loss on every assistant turn (completion_only_loss: the last only), marked by the template.
        assistant_only_loss=spec.data.messages_field is not None,
        optim=knobs.optimizer,
        learning_rate=train.learning_rate,
        lr_scheduler_type=train.lr_scheduler,
        max_grad_norm=train.max_grad_norm,
        max_steps=train.max_steps,
        num_train_epochs=train.epochs,
        save_strategy="steps",
        save_steps=train.save_steps,
        save_total_limit=None,  # we rotate ourselves, never deleting the resume source
        logging_steps=train.logging_steps,
        eval_strategy="steps" if evaluating else "no",
        eval_steps=train.eval_steps if evaluating else None,
        seed=train.seed,
        gradient_checkpointing=knobs.gradient_checkpointing,
        gradient_checkpointing_kwargs=activations.checkpointing_kwargs(),
        bf16=on_cuda and dtype == torch.bfloat16,
        fp16=on_cuda and dtype == torch.float16,
        use_cpu=not on_cuda,
        report_to=train.report_to,
        disable_tqdm=True,
        dataloader_num_workers=0,
        auto_find_batch_size=False,  # a restored batch size would undo the micro-batch rung
        # DDP: the unused-parameter search walks the graph each step and fails with checkpointing.
        ddp_find_unused_parameters=False,
        ddp_backend=("nccl" if on_cuda else "gloo") if torchrun.this_rank().distributed else None,
        **(sharding or {}),  # FSDP-QLoRA's (recipe/fsdp.py); none for DDP
        **{"warmup_ratio" if ratio else "warmup_steps": train.warmup_ratio},
    )
    return SFTConfig(**kwargs)


#: TensorBoard's directory in the run directory, shared by every attempt: a restarted run's curves continue.
TENSORBOARD_DIR = "tensorboard"


def report_env(spec: AttemptSpec) -> dict[str, str]:
    """Environment of the Trainer's reporting (TensorBoardCallback reads ``TENSORBOARD_LOGGING_DIR``)."""
    if spec.train.report_to != "tensorboard":
        return {}
    if find_spec("tensorboard") is None and find_spec("tensorboardX") is None:
        raise ConfigError(
            "train.report_to: tensorboard, but tensorboard is not installed in the trainer's environment: "
            "pip install tensorboard (or set report_to: none)"
        )
    return {"TENSORBOARD_LOGGING_DIR": str(Path(spec.run_dir) / TENSORBOARD_DIR)}


#: Injected fault for tests: ``knob_name`` makes the load fail with a plain RuntimeError while that
#: knob is on, as a rung the stack cannot run does (the 4-bit CPU-offload crash on meta tensors).
TEST_FAIL_WITH_KNOB = "QLORA_SUPERVISE_TEST_FAIL_WITH_KNOB"


def build(
    spec: AttemptSpec,
    progress: heartbeat.Progress,
    on_cuda: bool,
    source: checkpoints.ResumeSource,
    prepared: Prepared | None = None,
) -> SupervisedSFTTrainer:
    """A trainer ready to ``train(resume_from_checkpoint=source.load_from)``, its ``processing_class`` the
    tokenizer; ``prepared`` (a warm spare's) stands in for tokenizer and data made from the same inputs."""
    # One function, so the recipe reads as one script in the seeds' order.
    knobs = spec.knobs
    dtype = compute_dtype(spec.train.compute_dtype, on_cuda)
    os.environ.update(report_env(spec))
    ready = prepared if prepared is not None and prepared.serves(spec) else None
    laps = [("", time.monotonic())]  # the end of each phase, for trainer_ready: where a start's time goes
    # Before get_peft_model draws LoRA's A matrices (Trainer seeds later): every restart, the same adapter.
    set_seed(spec.train.seed)
    progress.enter(codes.Stage.LOAD)
    tokenizer = ready.tokenizer if ready else load_tokenizer(spec)
    laps.append(("tokenizer", time.monotonic()))
    fsdp.refuse_cpu(knobs, on_cuda)
    model = load_model(spec, dtype, on_cuda)
    laps.append(("weights", time.monotonic()))
    if (name := os.environ.get(TEST_FAIL_WITH_KNOB, "")) and getattr(knobs, name, False) is True:
        raise RuntimeError(f"injected fault ({TEST_FAIL_WITH_KNOB}): this stack cannot run {name}")
    check_target_modules(model, spec.train.target_modules)
    model = add_lora(model, knobs, spec, dtype)
    trainable, total, share = trainable_share(model)
    laps.append(("lora", time.monotonic()))
    train_set, eval_set, lengths = (
        (ready.train_set, ready.eval_set, ready.lengths) if ready else load_rows(spec, tokenizer)
    )
    if spec.data.messages_field is not None:
        check_chat_template(tokenizer)
    laps.append(("data", time.monotonic()))
    progress.events.emit(
        "loaded",
        trainable_params=trainable,
        total_params=total,
        trainable_share=share,
        linear4bit=sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()),  # 0: not 4-bit
        attn_implementation=model.config._attn_implementation,  # what the memory model must assume
        dtype=str(dtype),
        train_rows=len(train_set),
        eval_rows=len(eval_set) if eval_set is not None else 0,
        **memory.memory_numbers().fields(),
        **(lengths.fields() if lengths is not None else {}),
    )
    print(f"trainable params: {trainable} / {total} ({share:.3%})", flush=True)
    if on_cuda:  # the load's host peak is in the event above; from here the mark is training's
        memory.reset_host_peak()
    trainer = SupervisedSFTTrainer(
        model=model,
        args=sft_config(spec, dtype, on_cuda, eval_set is not None, fsdp.trainer_args(knobs, model)),
        train_dataset=train_set,
        eval_dataset=eval_set,
        processing_class=tokenizer,
        progress=progress,
        spec=spec,
        source=source,
    )
    laps.append(("trainer", time.monotonic()))
    progress.events.emit(
        "trainer_ready",
        phases_s={name: round(end - start, 3) for (_, start), (name, end) in pairwise(laps)},
        prepared=ready is not None,
        prepared_s=ready.seconds if ready else None,
    )
    return trainer
