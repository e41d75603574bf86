"""Changed jobs: every submitted version kept (``job.vN.yaml`` as submitted, ``job.vN.json`` resolved,
``job.yaml`` the newest), the diff against the recorded one, and generations: a change that is not
:attr:`FieldChange.safe` needs ``run --restart``, which moves the current generation whole into
``generations/<n>/`` (through ``.tmp-<n>/``, finished by the next ``run`` after a kill)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.jobfile.job import Job
from qlora_supervise.supervisor.record.journal import Lift, append_lift, read_attempts
from qlora_supervise.supervisor.record.rundir import RunDir, ensure_dir
from qlora_supervise.trainer_child.contract.durable import fsync_dir, write_text_atomic

SAFE_SECTIONS = ("supervise.", "resources.")
SAFE_FIELDS = frozenset({"train.save_steps", "train.logging_steps", "train.eval_steps", "train.merge"})
SAFE_WHEN_MORE = frozenset({"train.max_steps", "train.epochs"})
#: In a safe section but carried in the attempts' knobs, which a resumed run takes from its journal.
UNSAFE_FIELDS = frozenset({"resources.nproc_per_node", "resources.parallel"})
GENERATIONS = "generations"
TOOL_CONFIG = "trainer.config"
TOOL_CONFIG_PREFIX = TOOL_CONFIG + "."
#: What belongs to one generation (moved aside whole by ``--restart``); job versions stay.
_GENERATION_FILES = ("attempts.jsonl", "state.json", "events.jsonl")
_GENERATION_GLOBS = ("attempt-*", "checkpoints", "checkpoints-*", "adapter", "merged", ".tmp-*", ".old-*")


@dataclass(frozen=True)
class FieldChange:
    """One field of the job that differs from the recorded version."""

    name: str  # the job file's dotted name: ``lora.r``
    old: Any
    new: Any
    untrained: bool = False  # the generation has trained no step (a tool's own key then applies)

    @property
    def safe(self) -> bool:
        """Applies on resume without mixing two trainings into one adapter."""
        if self.name in UNSAFE_FIELDS:
            return False
        if self.name == TOOL_CONFIG or self.name.startswith(TOOL_CONFIG_PREFIX):
            return self.untrained
        if self.name.startswith(SAFE_SECTIONS) or self.name in SAFE_FIELDS:
            return True
        # A length that is no number trained nothing (the tool refuses it): any change is safe.
        return self.name in SAFE_WHEN_MORE and (
            not _is_number(self.old) or _number(self.new) >= _number(self.old)
        )

    def render(self, restarting: bool = False) -> str:
        """One line of the diff; ``restarting``: as ``run --restart`` says it, for the new generation."""
        how = "applies on resume" if self.safe else "changes what is trained: needs --restart"
        if self.safe and (self.name == TOOL_CONFIG or self.name.startswith(TOOL_CONFIG_PREFIX)):
            how = "applies: no step was trained yet"
        if restarting:
            how = "the new generation trains with it from step 0"
        return f"  {self.name}: {self.old!r} -> {self.new!r}  ({how})"

    def to_json(self) -> dict[str, Any]:
        return {"old": self.old, "new": self.new, "safe": self.safe}


def _is_number(value: Any) -> bool:
    return value is None or (isinstance(value, int | float) and not isinstance(value, bool))


def _number(value: Any) -> float:
    # max_steps -1 / None: "epochs decide", infinitely many steps; no number is never more training.
    if not _is_number(value):
        return float("nan")
    return float("inf") if value is None or value < 0 else float(value)


def job_view(job: Job) -> dict[str, Any]:
    """The job's resolved fields under the job file's dotted names (what a diff compares)."""
    knobs, train = job.knobs, job.train
    view: dict[str, Any] = {
        "model.path": knobs.model,
        "model.fallbacks": list(job.fallback_models),
        "model.trust_remote_code": train.trust_remote_code,
        "quantization.load_in_4bit": knobs.load_in_4bit,
        "quantization.quant_type": knobs.quant_type,
        "quantization.double_quant": knobs.double_quant,
        "quantization.compute_dtype": train.compute_dtype,
        "lora.r": knobs.lora_r,
        "lora.alpha": knobs.lora_alpha,
        "lora.dropout": train.lora_dropout,
        "lora.target_modules": train.target_modules,  # a tuple reads back as a list (below)
        "train.max_seq_len": knobs.max_seq_len,
        "train.micro_batch_size": knobs.micro_batch_size,
        "train.effective_batch_size": knobs.effective_batch,
        "train.gradient_checkpointing": knobs.gradient_checkpointing,
        "train.optimizer": knobs.optimizer,
        "train.eval_batch_size": knobs.eval_batch_size,
    }
    skip = {"lora_dropout", "target_modules", "compute_dtype", "trust_remote_code"}
    view.update({f"train.{k}": v for k, v in dataclasses.asdict(train).items() if k not in skip})
    view.update({f"data.{k}": v for k, v in dataclasses.asdict(job.data).items()})
    resources = dataclasses.asdict(job.resources)
    view["resources.gpu"] = resources.pop("device")
    view.update({f"resources.{k}": v for k, v in resources.items()})
    if knobs.world_size != 1:  # absent for one process, as in the views recorded before it existed
        view["resources.nproc_per_node"] = knobs.world_size
    if knobs.fsdp:  # likewise absent for DDP: a checkpoint's optimizer state is laid out by it
        view["resources.parallel"] = "fsdp"
    view.update({f"supervise.{k}": v for k, v in job.supervise.model_dump(mode="json").items()})
    view.update(job.trainer.config_view())
    view.update(job.unparsed)  # a tool's value that did not parse, as written: never its default
    return dict(json.loads(json.dumps(view, default=str)))  # as it reads back from disk


def diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[FieldChange]:
    """Every field whose value differs, in name order (a field only one side has counts too); the
    tool's keys only where ``old`` recorded them."""
    names = sorted(set(old) | set(new))
    if TOOL_CONFIG not in old:
        names = [n for n in names if n != TOOL_CONFIG and not n.startswith(TOOL_CONFIG_PREFIX)]
    return [FieldChange(n, old.get(n), new.get(n)) for n in names if old.get(n) != new.get(n)]


@dataclass(frozen=True)
class JobVersions:
    """``job.vN.yaml`` / ``job.vN.json`` in a run directory: every job it was given."""

    rd: RunDir

    def numbers(self) -> list[int]:
        tails = (path.name[len("job.v") : -len(".yaml")] for path in self.rd.root.glob("job.v*.yaml"))
        return sorted(int(tail) for tail in tails if tail.isdigit())

    def newest_view(self) -> dict[str, Any] | None:
        """The newest recorded version's fields (None: no version recorded, or unreadable)."""
        try:
            view = json.loads((self.rd.root / f"job.v{self.numbers()[-1]}.json").read_text(encoding="utf-8"))
        except (IndexError, OSError, ValueError):  # no version recorded, or unreadable
            return None
        return view if isinstance(view, dict) else None

    def record(self, job: Job) -> int:
        """Keep ``job`` as the next version (never overwriting one); ``job.yaml`` becomes it."""
        number = max(self.numbers(), default=0) + 1
        write_text_atomic(self.rd.root / f"job.v{number}.json", json.dumps(job_view(job), indent=2))
        write_text_atomic(self.rd.root / f"job.v{number}.yaml", job.raw_text)
        write_text_atomic(self.rd.job_copy, job.raw_text)
        return number


def extend_finished(rd: RunDir, changes: list[FieldChange], now: float) -> Lift | None:
    """A finished run whose job now asks for more steps goes on from its last checkpoint: a lift line after
    the last attempt, and an existing ``merged/`` moved to ``merged-before-extend-<n>/`` so the merge runs
    again. None, and nothing written, when no change raises the length or the journal is empty."""
    raised = [c for c in changes if c.name in SAFE_WHEN_MORE and _number(c.new) > _number(c.old)]
    records, _ = read_attempts(rd.attempts)
    if not raised or not records:
        return None
    last = records[-1].attempt
    if rd.merged.exists():
        os.rename(rd.merged, rd.root / f"merged-before-extend-{last}")
        fsync_dir(rd.root)
    why = "the job asks for more training: " + ", ".join(f"{c.name} {c.old} -> {c.new}" for c in raised)
    lift = Lift(last, "succeeded", why, now)
    append_lift(rd.attempts, lift)
    return lift


def has_attempts(rd: RunDir) -> bool:
    """The current generation has anything to keep (a journal or an attempt directory)."""
    return rd.attempts.exists() or any(rd.root.glob("attempt-*"))


def finish_interrupted_move(rd: RunDir) -> Path | None:
    """A generation move a kill cut short is completed (it was asked for with ``--restart``)."""
    root = rd.root / GENERATIONS
    pending = sorted(root.glob(".tmp-*")) if root.is_dir() else []
    return _move_into(rd, pending[0], root / pending[0].name.removeprefix(".tmp-")) if pending else None


def start_generation(rd: RunDir) -> Path:
    """Move the current generation into ``generations/<n>/``; the run directory starts afresh."""
    root = ensure_dir(rd.root / GENERATIONS)
    number = max((int(p.name) for p in root.iterdir() if p.name.isdigit()), default=0) + 1
    staging = ensure_dir(root / f".tmp-{number}")
    if rd.job_copy.is_file():
        shutil.copy2(rd.job_copy, staging / "job.yaml")  # the job this generation trained
    return _move_into(rd, staging, root / str(number))


def _move_into(rd: RunDir, staging: Path, final: Path) -> Path:
    entries = [rd.root / name for name in _GENERATION_FILES if (rd.root / name).exists()]
    globbed = [path for pattern in _GENERATION_GLOBS for path in sorted(rd.root.glob(pattern))]
    for entry in [*entries, *globbed]:
        os.rename(entry, staging / entry.name)
    fsync_dir(rd.root)
    os.rename(staging, final)
    fsync_dir(final.parent)
    return final
