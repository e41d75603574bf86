"""A script with its settings in its code (``trainer.kind: script``): which knobs the shim changes
where the script builds them (:data:`CHANGES_FILE` beside ``spec.json``, written by the
supervisor), and one :class:`KnobSetting` per value it saw, in the ``script_knobs`` event.
Attempt 1 changes nothing: it learns what the script asks for."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from pydantic import TypeAdapter

from qlora_supervise.trainer_child.contract.durable import write_text_atomic
from qlora_supervise.trainer_child.contract.spec import Knobs

CHANGES_FILE = "script-knobs.json"
Value = bool | int | float | str | None
#: Knobs that move together: when the script overrides one after the Trainer is built, the shim
#: puts the others back as the script asked (the effective batch stays the script's).
TOGETHER = frozenset({"micro_batch_size", "grad_accum"})
_KNOBS = frozenset(field.name for field in dataclasses.fields(Knobs))
#: lr_scheduler_type values TrainingArguments refuses without an eval strategy ("... requires an eval
#: strategy"): with one of them the ladder leaves evaluation on (scripts and tools alike).
EVAL_SCHEDULERS = frozenset({"reduce_lr_on_plateau", "greedy"})


@dataclasses.dataclass(frozen=True)
class ScriptChanges:
    """What the shim changes in one attempt: ``knobs`` take the spec's values; ``replaced_model``: the
    script's own model where a fallback changes it (its tokenizer swapped too); ``asked``: per changed
    knob, what the script is taken to ask for (it runs with that where it builds nothing taking the knob)."""

    knobs: tuple[str, ...]
    output_dir: str
    replaced_model: str | None = None
    asked: dict[str, Value] = dataclasses.field(default_factory=dict)

    def write(self, attempt_dir: Path) -> None:
        write_text_atomic(attempt_dir / CHANGES_FILE, json.dumps(dataclasses.asdict(self), indent=2) + "\n")

    @classmethod
    def read(cls, attempt_dir: Path) -> ScriptChanges | None:
        """The attempt's changes; None when it has none (not a script attempt)."""
        try:
            text = (attempt_dir / CHANGES_FILE).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        return TypeAdapter(cls).validate_json(text)


@dataclasses.dataclass(frozen=True)
class KnobSetting:
    """One value the script builds (``key`` in ``where``); ``why_not``: the attempt's was not applied."""

    knob: str
    key: str
    asked: Value
    got: Value
    where: str
    why_not: str | None = None

    def line(self) -> str:
        """``per_device_train_batch_size: 16 -> 8 (applied at SFTConfig)``, as ``status`` prints it."""
        if self.why_not is not None:
            return f"{self.key}: {self.asked} (not applied: {self.why_not})"
        if self.asked == self.got:
            return f"{self.key}: {self.asked} (as the script asked, at {self.where})"
        return f"{self.key}: {self.asked} -> {self.got} (applied at {self.where})"


def as_built(planned: Knobs, settings: Iterable[KnobSetting]) -> Knobs:
    """``planned`` with what the script built (the last value; checkpointing: on in any place)."""
    return with_values(planned, _knobs((s.knob, s.got) for s in settings))


def with_values(knobs: Knobs, values: Mapping[str, Value]) -> Knobs:
    return dataclasses.replace(knobs, **values) if values else knobs  # type: ignore[arg-type]


def asked(settings: Iterable[KnobSetting]) -> dict[str, Value]:
    """What the script asks for, knob by knob (gradient checkpointing: on in any of its places)."""
    return _knobs((s.knob, s.asked) for s in settings)


def _knobs(pairs: Iterable[tuple[str, Value]]) -> dict[str, Value]:
    out: dict[str, Value] = {}
    for knob, value in pairs:
        if knob in _KNOBS and value is not None:
            out[knob] = (bool(out.get(knob)) or bool(value)) if knob == "gradient_checkpointing" else value
    return out


def unapplied(settings: Sequence[KnobSetting]) -> tuple[str, ...]:
    """The knobs the attempt could not change where the script builds them."""
    return tuple(dict.fromkeys(s.knob for s in settings if s.why_not is not None))
