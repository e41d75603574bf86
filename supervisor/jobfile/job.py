"""The validated job: the specs that cross to the child, exactly as it receives them, built once
from the job file's sections (:func:`job_from_sections` is the one map from sections to specs)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from qlora_supervise.supervisor.facts.trainer import OwnTrainer, Trainer
from qlora_supervise.supervisor.jobfile import schema
from qlora_supervise.trainer_child.contract.spec import DataSpec, DiagnoseSpec, Knobs, Resources, TrainSpec

#: Said by ``validate`` and at run start when the job trusts the model's code.
TRUST_REMOTE_CODE_WARNING = (
    "model.trust_remote_code is true: Python code from the model directory will run in the "
    "trainer, with this user's rights; keep it false unless you have read that code"
)
_S = TypeVar("_S", bound=schema.Section)


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
    supervise: schema.SuperviseSection  # durations already seconds; ``ladders`` are the overrides
    fallback_models: tuple[str, ...]  # model.fallbacks, absolute
    diagnose: DiagnoseSpec = field(default_factory=DiagnoseSpec)
    trainer: Trainer = field(default_factory=OwnTrainer)  # ours, or the ``trainer:`` section's tool
    # A tool's config fields that did not parse (``max_steps: ten``), as written, by job view name.
    unparsed: Mapping[str, Any] = field(default_factory=dict)


def _section(sections: Mapping[str, schema.Section], name: str, kind: type[_S]) -> _S:
    section = sections[name]
    if not isinstance(section, kind):  # a bug in load, never a problem of the job file
        raise TypeError(f"section {name!r} is a {type(section).__name__}, not a {kind.__name__}")
    return section


def job_from_sections(
    job_file: Path, raw_text: str, output_dir: Path, sections: Mapping[str, schema.Section]
) -> Job:
    """The Job of sections that each validated whole (``load_job`` calls this after every check)."""
    model = _section(sections, "model", schema.ModelSection)
    data = _section(sections, "data", schema.DataSection)
    quantization = _section(sections, "quantization", schema.QuantizationSection)
    lora = _section(sections, "lora", schema.LoraSection)
    train = _section(sections, "train", schema.TrainSection)
    resources = _section(sections, "resources", schema.ResourcesSection)
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
        # The recipe settings: max_steps None (epochs decide) is -1; epochs null keeps the spec's
        # default (the trainer ignores epochs when max_steps > 0).
        train=TrainSpec(
            learning_rate=train.learning_rate,
            lr_scheduler=train.lr_scheduler,
            warmup_ratio=train.warmup_ratio,
            max_grad_norm=train.max_grad_norm,
            max_steps=-1 if train.max_steps is None else train.max_steps,
            epochs=TrainSpec.epochs if train.epochs is None else float(train.epochs),
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
        ),
        resources=resources.spec(),
        supervise=_section(sections, "supervise", schema.SuperviseSection),
        fallback_models=tuple(str(path) for path in model.fallbacks),
        diagnose=_section(sections, "diagnose", schema.DiagnoseSection).spec(),
    )
