"""The attempt's knobs, applied where a script with its settings in its code builds them, once each module
loads (:func:`patches`); every value seen is reported. A value the script sets after building its Trainer
is reported as not applied, and its effective-batch partner put back."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import os
from collections.abc import Callable
from types import ModuleType
from typing import Any

from qlora_supervise.trainer_child.contract import script_knobs
from qlora_supervise.trainer_child.contract.attempt_facts import MAX_REPORTED_LENGTHS, SampleLengths
from qlora_supervise.trainer_child.contract.events import Loaded, ScriptKnobs
from qlora_supervise.trainer_child.contract.script_knobs import KnobSetting, ScriptChanges, Value
from qlora_supervise.trainer_child.contract.spec import Knobs

#: knob -> the TrainingArguments field (``max_seq_len``: trl's SFTConfig, where the class has it).
ARGUMENTS = {
    "micro_batch_size": "per_device_train_batch_size",
    "grad_accum": "gradient_accumulation_steps",
    "gradient_checkpointing": "gradient_checkpointing",
    "optimizer": "optim",
    "eval_batch_size": "per_device_eval_batch_size",
    "eval_enabled": "eval_strategy",
    "max_seq_len": "max_length",
}
QUANTIZATION = {"quant_type": "bnb_4bit_quant_type", "double_quant": "bnb_4bit_use_double_quant"}
LORA = {"lora_r": "r", "lora_alpha": "lora_alpha"}
#: Where each knob is built, for the report of a knob the script builds nothing for.
PLACES = {
    **dict.fromkeys(ARGUMENTS, "TrainingArguments"),
    **dict.fromkeys(QUANTIZATION, "BitsAndBytesConfig"),
    **dict.fromkeys(LORA, "LoraConfig"),
    "bf16_head": "prepare_model_for_kbit_training",
}
PREPARE = "prepare_model_for_kbit_training"
BEST = "load_best_model_at_end"
NAME = "pretrained_model_name_or_path"


def _plain(value: Any) -> Value:
    """An enum (``OptimizerNames``, ``IntervalStrategy``) as its string; other values as they are."""
    value = getattr(value, "value", value)
    return value if isinstance(value, (bool, int, float, str)) or value is None else str(value)


def _read(knob: str, value: Any) -> Value:
    return _plain(value) != "no" if knob == "eval_enabled" else _plain(value)


def _model_name(name: str | os.PathLike[str]) -> str:
    """A local folder as an absolute path (the supervisor reads it from elsewhere), else the name."""
    path = os.fspath(name)
    return os.path.abspath(path) if os.path.isdir(path) else path


class Ledger:
    """The changes of one attempt and every value the script built, in the order it built them."""

    def __init__(self, changes: ScriptChanges, knobs: Knobs) -> None:
        self.output_dir = changes.output_dir
        self.replaced_model = changes.replaced_model
        self.changes = {name: getattr(knobs, name) for name in changes.knobs}
        self.asked = changes.asked  # what a knob nothing takes stays at: the script's own
        self.settings: list[KnobSetting] = []

    def _take(self, knob: str, key: str, asked: Value, where: str) -> Value:
        """Record the script's value; the attempt's value when it changes this knob."""
        got = self.changes.get(knob, asked)
        self.settings.append(KnobSetting(knob, key, asked, got, where))
        return got

    def on_arguments(self, args: Any) -> None:
        where = type(args).__name__
        fields = {f.name for f in dataclasses.fields(args)}
        scheduler = _plain(getattr(args, "lr_scheduler_type", None))
        held: str | None = None  # only a scheduler that steps on the eval loss keeps evaluation on
        if scheduler in script_knobs.EVAL_SCHEDULERS:
            held = f"lr_scheduler_type {scheduler} needs an eval strategy: evaluation stays on"
        for knob, key in ARGUMENTS.items():
            if key not in fields:
                if knob in self.changes:
                    why = f"{where} has no {key}: the script sets it in its own code"
                    self.settings.append(KnobSetting(knob, key, None, self.asked.get(knob), where, why))
                continue
            asked = _read(knob, getattr(args, key))
            if knob == "eval_enabled" and held is not None:
                # Not applied, changed or not: its rung leaves the ladder from the first report.
                self.settings.append(KnobSetting(knob, key, asked, asked, where, held))
                continue
            if (got := self._take(knob, key, asked, where)) != asked:
                setattr(args, key, ("steps" if got else "no") if knob == "eval_enabled" else got)
        if self.changes.get("eval_enabled") is False and held is None and getattr(args, BEST, False):
            # Its __post_init__ refuses the best model at the end without eval (strategies must match).
            self.settings.append(KnobSetting(BEST, BEST, True, False, where))
            setattr(args, BEST, False)
        self.settings.append(KnobSetting("output_dir", "output_dir", args.output_dir, self.output_dir, where))
        args.output_dir = self.output_dir  # its saves and save_model() land in the run directory

    def on_quantization(self, bound: inspect.BoundArguments) -> None:
        for knob, key in QUANTIZATION.items():
            bound.arguments[key] = self._take(knob, key, _plain(bound.arguments[key]), "BitsAndBytesConfig")

    def on_lora(self, config: Any) -> None:
        for knob, key in LORA.items():
            setattr(config, key, self._take(knob, key, getattr(config, key), "LoraConfig"))

    def on_model(self, klass: Any, name: str | os.PathLike[str]) -> Any:
        """``from_pretrained``'s model: the attempt's where the ladder changed it."""
        asked = _model_name(name)
        got = self._take("model", NAME, asked, f"{klass.__name__}.from_pretrained")
        return name if got == asked else got

    def on_tokenizer(self, klass: Any, name: str | os.PathLike[str]) -> Any:
        """The tokenizer of the script's model is the attempt's model's, where it changed."""
        asked = _model_name(name)
        swap = self.replaced_model is not None and asked == self.replaced_model
        got = self.changes["model"] if swap else asked
        self.settings.append(KnobSetting("tokenizer", NAME, asked, got, "AutoTokenizer.from_pretrained"))
        return got if swap else name

    def on_prepare(self, kwargs: dict[str, Any]) -> bool:
        """Checkpointing as the attempt has it; True when the attempt keeps the head in bf16."""
        key = "use_gradient_checkpointing"
        asked = bool(kwargs.get(key, True))  # peft's default: on
        kwargs[key] = self._take("gradient_checkpointing", key, asked, PREPARE)
        return bool(self._take("bf16_head", "bf16_head", False, PREPARE))

    def check(self, trainer: Any) -> None:
        """The Trainer's arguments as ``train()`` will read them (see the module docstring)."""
        args, where = trainer.args, type(trainer.args).__name__
        overridden: set[str] = set()
        for i, s in enumerate(self.settings):
            if s.where != where or s.knob not in ARGUMENTS or not hasattr(args, s.key):
                continue
            if (now := _read(s.knob, getattr(args, s.key))) == s.got:
                continue
            if s.knob in self.changes:
                why = f"the script sets it to {now} after building its Trainer, past the shim's reach"
                self.settings[i] = dataclasses.replace(s, got=now, why_not=why)
                overridden.add(s.knob)
            else:  # the script's own second thought: what it asks for is what it set last
                self.settings[i] = dataclasses.replace(s, asked=now, got=now)
        if overridden & script_knobs.TOGETHER:  # the partners go back as the script asked
            partners, named = script_knobs.TOGETHER - overridden, ", ".join(sorted(overridden))
            for i, s in enumerate(self.settings):
                if s.where == where and s.knob in partners and s.why_not is None and s.got != s.asked:
                    setattr(args, s.key, s.asked)
                    why = f"put back as the script asked, with {named}: the effective batch kept"
                    self.settings[i] = dataclasses.replace(s, got=s.asked, why_not=why)
            trainer._train_batch_size = args.train_batch_size  # Trainer copied it at construction
        seen = {s.knob for s in self.settings}
        for knob in self.changes.keys() - seen:  # by train() the script has built all it will
            place = PLACES.get(knob, "place the shim reaches")
            why = f"the script builds no {place}, so nothing of it takes this knob"
            self.settings.append(KnobSetting(knob, knob, None, self.asked.get(knob), "-", why))

    def report(self, events: Any, trainer: Any | None) -> None:
        """The ``script_knobs`` event; with a Trainer, ``loaded`` too: its rows and their lengths."""
        config: Any = getattr(getattr(trainer, "model", None), "config", None)
        config = config.to_dict() if hasattr(config, "to_dict") else None
        plain = config and {k: v for k, v in config.items() if isinstance(v, (bool, int, float, str))}
        events.write(ScriptKnobs(tuple(self.settings), plain, trainer is not None).to_line())
        if trainer is None:
            return
        rows: Any = getattr(trainer, "train_dataset", None)
        try:  # the tokenized rows' lengths, as our child reports them
            total = len(rows)
            every = max(1, total // MAX_REPORTED_LENGTHS)
            lengths = SampleLengths(total, tuple(len(rows[i]["input_ids"]) for i in range(0, total, every)))
        except Exception:  # not a tokenized, indexable dataset: the supervisor goes without lengths
            return
        events.write(Loaded(train_rows=lengths.rows, sample_lengths=lengths).to_line())


def _post_init(attr: str, hook: Callable[[Any], None]) -> Callable[[ModuleType], None]:
    """A patch that runs ``hook(instance)`` before ``module.<attr>.__post_init__``."""

    def patch(module: ModuleType) -> None:
        cls = getattr(module, attr)
        original = cls.__post_init__

        @functools.wraps(original)
        def post_init(self: Any, *args: Any, **kwargs: Any) -> Any:
            hook(self)
            return original(self, *args, **kwargs)

        cls.__post_init__ = post_init

    return patch


def _from_pretrained(attr: str, hook: Callable[[Any, Any], Any]) -> Callable[[ModuleType], None]:
    """A patch: ``module.<attr>.from_pretrained`` loads what ``hook(klass, name)`` returns for a name."""

    def patch(module: ModuleType) -> None:
        cls = getattr(module, attr)
        original = cls.__dict__["from_pretrained"].__func__

        @functools.wraps(original)
        def from_pretrained(klass: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
            named = isinstance(name, (str, os.PathLike))
            return original(klass, hook(klass, name) if named else name, *args, **kwargs)

        cls.from_pretrained = classmethod(from_pretrained)

    return patch


def patches(ledger: Ledger) -> dict[str, Callable[[ModuleType], None]]:
    """module name -> what to patch in it once it has loaded."""

    def quantization(module: ModuleType) -> None:
        cls = module.BitsAndBytesConfig
        original, signature = cls.__init__, inspect.signature(cls.__init__)

        @functools.wraps(original)
        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            ledger.on_quantization(bound)
            original(*bound.args, **bound.kwargs)

        cls.__init__ = init

    def prepare(module: ModuleType) -> None:
        # Not imported at the shim's start: it imports torch, which must load after the environment is set.
        from qlora_supervise.trainer_child.recipe import head

        # `from peft import prepare_model_for_kbit_training` reads the name where peft binds it.
        for owner in (module, module.utils, module.utils.other):
            original = getattr(owner, PREPARE)

            @functools.wraps(original)
            def wrapped(model: Any, *args: Any, _original: Any = original, **kwargs: Any) -> Any:
                if args:  # its second positional parameter is use_gradient_checkpointing
                    kwargs["use_gradient_checkpointing"], args = args[0], args[1:]
                if not ledger.on_prepare(kwargs):
                    return _original(model, *args, **kwargs)
                with head.kept_out_of_upcast(head.head_parameters(model), None):  # as loaded
                    prepared = _original(model, *args, **kwargs)
                head.match_head_input(prepared)
                return prepared

            setattr(owner, PREPARE, wrapped)

    return {
        "transformers.training_args": _post_init("TrainingArguments", ledger.on_arguments),
        "transformers.utils.quantization_config": quantization,
        # A classmethod of the Auto classes' base: every AutoModelFor... loads through it.
        "transformers.models.auto.auto_factory": _from_pretrained("_BaseAutoModelClass", ledger.on_model),
        "transformers.models.auto.tokenization_auto": _from_pretrained("AutoTokenizer", ledger.on_tokenizer),
        "peft.tuners.lora.config": _post_init("LoraConfig", ledger.on_lora),
        "peft": prepare,
    }
