"""The validated job: the specs that cross to the child, built once from the job file's sections.

A :class:`Job` holds what the rest of the supervisor reads, and nothing it would have to
translate again: attempt 1's :class:`Knobs`, the :class:`DataSpec`, :class:`TrainSpec` and
:class:`Resources` exactly as the child receives them, and the validated supervise section.
:func:`job_from_sections` is the one place where the job file's layout (sections) is mapped
onto the contract's layout (specs).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from qlora_supervise.supervisor.facts.trainer import OwnTrainer, Trainer
from qlora_supervise.supervisor.jobfile.schema import (
    DataSection,
    DiagnoseSection,
    LoraSection,
    ModelSection,
    QuantizationSection,
    ResourcesSection,
    Section,
    SuperviseSection,
    TrainSection,
)
from qlora_supervise.trainer_child.contract.spec import DataSpec, DiagnoseSpec, Knobs, Resources, TrainSpec

#: Said by ``validate`` and at run start (console and ``events.jsonl``) when the job trusts the
#: model's code: the model directory's Python files run with the supervisor's user (root under
#: the shipped unit).
TRUST_REMOTE_CODE_WARNING = (
    "model.trust_remote_code is true: Python code from the model directory will run in the "
    "trainer, with this user's rights; keep it false unless you have read that code"
)


@dataclass(frozen=True)
class Job:
    """A validated job. Paths are absolute; durations are seconds; sizes are bytes."""

    job_file: Path  # absolute path of the job file
    raw_text: str  # the job as submitted, copied into the run directory
    output_dir: Path
    knobs: Knobs  # attempt 1's knobs, before any rung has changed them
    data: DataSpec
    train: TrainSpec  # the recipe settings no rung changes
    resources: Resources
    supervise: SuperviseSection  # durations already seconds; ``ladders`` are the overrides
    fallback_models: tuple[str, ...]  # model.fallbacks, absolute
    diagnose: DiagnoseSpec = field(
        default_factory=DiagnoseSpec
    )  # opt-in diagnostics, as the child receives them
    # Our own child, or the tool of the job's ``trainer:`` section (supervisor/trainers/).
    trainer: Trainer = field(default_factory=OwnTrainer)
    # Fields of a tool's config that did not parse (``max_steps: ten``), under the job view's
    # names, as written: the spec carries the default, the run's record keeps what the user wrote.
    unparsed: Mapping[str, Any] = field(default_factory=dict)


_S = TypeVar("_S", bound=Section)
_TRAIN = TrainSpec()  # the protocol's defaults


def _section(sections: Mapping[str, Section], name: str, kind: type[_S]) -> _S:
    """The validated section ``name``, checked to be of ``kind``."""
    section = sections[name]
    if not isinstance(section, kind):  # a bug in load, never a problem of the job file
        raise TypeError(f"section {name!r} is a {type(section).__name__}, not a {kind.__name__}")
    return section


def job_from_sections(
    job_file: Path, raw_text: str, output_dir: Path, sections: Mapping[str, Section]
) -> Job:
    """The Job of sections that each validated whole (``load_job`` calls this after every check)."""
    # Long only because it names every field once: this is the one map from sections to specs.
    model = _section(sections, "model", ModelSection)
    data = _section(sections, "data", DataSection)
    quantization = _section(sections, "quantization", QuantizationSection)
    lora = _section(sections, "lora", LoraSection)
    train = _section(sections, "train", TrainSection)
    resources = _section(sections, "resources", ResourcesSection)
    return Job(
        job_file=job_file,
        raw_text=raw_text,
        output_dir=output_dir,
        knobs=Knobs(
            model=str(model.path),
            micro_batch_size=train.micro_batch_size,
            # Per rank: the effective batch is micro-batch x accumulation x ranks.
            grad_accum=train.effective_batch_size // (train.micro_batch_size * resources.nproc_per_node),
            max_seq_len=train.max_seq_len,
            gradient_checkpointing=train.gradient_checkpointing,
            optimizer=train.optimizer,
            lora_r=lora.r,
            lora_alpha=lora.alpha,
            quant_type=quantization.quant_type,
            double_quant=quantization.double_quant,
            load_in_4bit=quantization.load_in_4bit,
            eval_batch_size=train.eval_batch_size,
            expandable_segments=resources.expandable_segments,
            eval_enabled=data.eval_path is not None or data.eval_fraction > 0,
            world_size=resources.nproc_per_node,
            fsdp=resources.parallel == "fsdp",
        ),
        data=DataSpec(
            path=str(data.path),
            text_field=data.text_field,
            messages_field=data.messages_field,
            eval_path=None if data.eval_path is None else str(data.eval_path),
            eval_fraction=data.eval_fraction,
        ),
        train=_train_spec(model, quantization, lora, train),
        resources=Resources(
            device=resources.gpu,
            gpu_memory_limit=resources.gpu_memory_limit,
            cpu_memory_limit=resources.cpu_memory_limit,
            host_memory_limit=resources.host_memory_limit,
        ),
        supervise=_section(sections, "supervise", SuperviseSection),
        fallback_models=tuple(str(path) for path in model.fallbacks),
        diagnose=_diagnose_spec(sections),
    )


def _diagnose_spec(sections: Mapping[str, Section]) -> DiagnoseSpec:
    section = _section(sections, "diagnose", DiagnoseSection)
    return DiagnoseSpec(section.memory_history, section.memory_history_entries)


def _train_spec(
    model: ModelSection, quantization: QuantizationSection, lora: LoraSection, train: TrainSection
) -> TrainSpec:
    """The TrainSpec: the recipe settings of the model, quantization, lora and train sections."""
    # max_steps None (epochs decide) is -1 in the spec; with max_steps set, epochs may be null and
    # the spec then keeps its own default (the trainer ignores epochs when max_steps > 0).
    return TrainSpec(
        learning_rate=train.learning_rate,
        lr_scheduler=train.lr_scheduler,
        warmup_ratio=train.warmup_ratio,
        max_grad_norm=train.max_grad_norm,
        max_steps=-1 if train.max_steps is None else train.max_steps,
        epochs=_TRAIN.epochs if train.epochs is None else float(train.epochs),
        save_steps=train.save_steps,
        logging_steps=train.logging_steps,
        eval_steps=train.eval_steps,
        packing=train.packing,
        seed=train.seed,
        lora_dropout=lora.dropout,
        target_modules=lora.target_modules,
        compute_dtype=quantization.compute_dtype,
        trust_remote_code=model.trust_remote_code,
        merge=train.merge,
        report_to=train.report_to,
    )
