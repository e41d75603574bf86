"""``trainer.kind: script`` without a trainer: its job, its attempt files, what it reports and what
the policy does with a knob it could not change (the real runs: test_trainer_script_real.py)."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path

import pytest
import yaml

from qlora_supervise.policies.decide import unusable_rungs
from qlora_supervise.policies.verdicts import PastAttempt, Settings
from qlora_supervise.supervisor.jobfile.problems import JobError
from qlora_supervise.supervisor.loop.settings import with_script_model
from qlora_supervise.supervisor.trainers.job import load_job
from qlora_supervise.supervisor.trainers.trainer import read_diff
from qlora_supervise.trainer_child.contract.events import ScriptKnobs
from qlora_supervise.trainer_child.contract.script_knobs import (
    KnobSetting,
    ScriptChanges,
    as_built,
    unapplied,
)
from qlora_supervise.trainer_child.contract.spec import Knobs
from qlora_supervise.trainer_child.shim import script

#: What a tutorial's script builds, as its shim reports it.
BUILT = (
    KnobSetting(
        "gradient_checkpointing", "use_gradient_checkpointing", True, True, "prepare_model_for_kbit_training"
    ),
    KnobSetting("micro_batch_size", "per_device_train_batch_size", 16, 16, "SFTConfig"),
    KnobSetting("grad_accum", "gradient_accumulation_steps", 1, 1, "SFTConfig"),
    KnobSetting("gradient_checkpointing", "gradient_checkpointing", False, False, "SFTConfig"),
    KnobSetting("output_dir", "output_dir", "out", "/run/trainer-output", "SFTConfig"),
)


def _job(tmp_path: Path, command: list[str]) -> Path:
    job = {
        "trainer": {"kind": "script", "command": command},
        "resources": {"gpu": "cpu"},
        "output_dir": "run",
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


def _problems(path: Path) -> list[str]:
    with pytest.raises(JobError) as caught:
        load_job(path)
    return [p.render() for p in caught.value.problems]


def test_validate_names_a_missing_script_and_a_command_without_one(tmp_path: Path) -> None:
    """The script must be a .py file in the job's folder (or trainer.workdir): each problem says the fix."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    assert load_job(_job(tmp_path, [sys.executable, "train.py"])).trainer.kind == "script"
    [missing] = _problems(_job(tmp_path, [sys.executable, "trian.py"]))
    assert "trainer.command: no such script" in missing and str(tmp_path / "trian.py") in missing
    assert "write [python, train.py, ...]" in missing
    [none] = _problems(_job(tmp_path, [sys.executable, "-c", "pass"]))
    assert "names no .py script to run" in none


def test_attempt_one_changes_nothing_and_a_later_attempt_names_the_ladders_knobs(tmp_path: Path) -> None:
    """Before the script has reported, an attempt changes nothing; after it, only the knobs that
    differ from what it built, in its own keys; the command is the user's, unchanged."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    job = load_job(_job(tmp_path, [sys.executable, "train.py"]))
    run, first = tmp_path / "run", tmp_path / "run" / "attempt-001"
    first.mkdir(parents=True)
    assert job.trainer.attempt_argv(first, run, job.knobs, job.knobs, None) == (sys.executable, "train.py")
    assert ScriptChanges.read(first) == ScriptChanges((), str(run / "trainer-output"))
    # Attempt 1 died loading, having built its arguments only: r, never reported, does not change.
    (first / "child-events.jsonl").write_text(ScriptKnobs(settings=BUILT).to_line())
    second = run / "attempt-002"
    second.mkdir()
    plan = as_built(job.knobs, BUILT)
    halved = dataclasses.replace(plan, micro_batch_size=8, grad_accum=2, lora_r=plan.lora_r // 2)
    job.trainer.attempt_argv(second, run, job.knobs, halved, None)
    assert ScriptChanges.read(second) == ScriptChanges(
        ("micro_batch_size", "grad_accum"),
        str(run / "trainer-output"),
        asked={"micro_batch_size": 16, "grad_accum": 1},
    )
    # Once an attempt reached train(), a knob it never built is changed all the same.
    (first / "child-events.jsonl").write_text(ScriptKnobs(settings=BUILT, complete=True).to_line())
    # Checkpointing as the script built it (on): no change; the shim will say nothing takes r.
    job.trainer.attempt_argv(second, run, job.knobs, halved, None)
    changes = ScriptChanges.read(second)
    assert changes is not None and changes.knobs == ("micro_batch_size", "grad_accum", "lora_r")
    diff = ["per_device_train_batch_size: 16 -> 8", "gradient_accumulation_steps: 1 -> 2", "r: 8 -> 4"]
    assert read_diff(second) == diff
    assert json.loads((first / "child-events.jsonl").read_text())["event"] == "script_knobs"
    # What `plan` reads of the job from then on: the script's own values.
    built = job.trainer.built_knobs(job.knobs, run)
    assert (built.micro_batch_size, built.grad_accum, built.gradient_checkpointing) == (16, 1, True)


def test_what_the_script_built_becomes_the_attempts_knobs_and_an_unapplied_knob_its_rungs_unusable() -> None:
    """Checkpointing turned on by prepare_model_for_kbit_training counts; a knob the script set after
    building its Trainer takes the rungs on it out of the rest of the run."""
    knobs = as_built(Knobs(model="m", micro_batch_size=1, grad_accum=8, gradient_checkpointing=False), BUILT)
    assert (knobs.micro_batch_size, knobs.grad_accum, knobs.gradient_checkpointing) == (16, 1, True)
    overridden = (
        *BUILT[:2],
        dataclasses.replace(BUILT[2], got=1, why_not="the script sets it to 1 after building its Trainer"),
    )
    assert unapplied(overridden) == ("grad_accum",)
    assert unapplied(BUILT) == ()
    micro = dataclasses.replace(BUILT[1], why_not="put back as the script asked")
    past = PastAttempt(knobs, None, 0, unapplied=unapplied((micro,)))
    assert "halve_micro_batch" in unusable_rungs([past]) and "halve_micro_batch" not in unusable_rungs([])


def test_a_knob_nothing_of_the_script_takes_is_recorded_as_the_script_ran_it(tmp_path: Path) -> None:
    """r halved for a script that builds no LoraConfig: the attempt's knobs as built keep the
    script's r (the plan's never ran), and the knob is named not applied."""
    (tmp_path / "train.py").write_text("print('hi')\n")
    job = load_job(_job(tmp_path, [sys.executable, "train.py"]))
    run, first, second = tmp_path / "run", tmp_path / "run" / "attempt-001", tmp_path / "run" / "attempt-002"
    first.mkdir(parents=True)
    (first / "child-events.jsonl").write_text(ScriptKnobs(settings=BUILT, complete=True).to_line())
    second.mkdir()
    plan = as_built(job.knobs, BUILT)
    halved = dataclasses.replace(plan, lora_r=plan.lora_r // 2)
    job.trainer.attempt_argv(second, run, job.knobs, halved, None)
    changes = ScriptChanges.read(second)
    assert changes is not None
    ledger = script.Ledger(changes, halved)
    ledger.check(types.SimpleNamespace(args=types.SimpleNamespace()))  # by train(): no LoraConfig
    assert as_built(halved, ledger.settings) == plan
    assert unapplied(ledger.settings) == ("lora_r",)


def test_turning_eval_off_turns_the_scripts_best_model_at_end_off_with_it(tmp_path: Path) -> None:
    """transformers refuses load_best_model_at_end without evaluation: the shim that turns eval off
    turns it off too, and reports it."""
    from transformers import TrainingArguments

    args_class = type("Args", (TrainingArguments,), {})  # patched alone: TrainingArguments stays as is
    ledger = script.Ledger(
        ScriptChanges(("eval_enabled",), str(tmp_path)), Knobs(model="m", eval_enabled=False)
    )
    script.patches(ledger)["transformers.training_args"](types.SimpleNamespace(TrainingArguments=args_class))
    args = args_class(
        output_dir=str(tmp_path), eval_strategy="steps", eval_steps=5, save_strategy="steps", save_steps=10,
        load_best_model_at_end=True,
    )  # fmt: skip
    assert (args.eval_strategy, args.load_best_model_at_end) == ("no", False)
    lines = [s.line() for s in ledger.settings if s.asked != s.got and s.knob != "output_dir"]
    assert lines == [
        "eval_strategy: True -> False (applied at Args)",
        "load_best_model_at_end: True -> False (applied at Args)",
    ]


def test_the_model_config_a_script_reports_gives_the_later_attempts_a_shape() -> None:
    """The job named no model; the config the script's attempt loaded is the memory model's from then on."""
    config = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 4, "intermediate_size": 128, "vocab_size": 1000}  # fmt: skip
    settings = with_script_model(Settings(), [ScriptKnobs(settings=BUILT, model_config=config)])
    assert settings.shape is not None and (settings.shape.hidden, settings.shape.layers) == (64, 2)
    assert with_script_model(Settings(), [ScriptKnobs(settings=BUILT)]).shape is None


@pytest.mark.parametrize("changes", [(), ("eval_enabled",)])
def test_a_scheduler_that_needs_eval_keeps_the_scripts_eval_on_and_disable_eval_off_the_ladder(
    changes: tuple[str, ...], tmp_path: Path
) -> None:
    """A plateau scheduler needs an eval strategy: eval is reported not applicable from attempt 1 (the
    rung leaves the ladder), and an attempt that asks for it off builds with eval on."""
    from transformers import TrainingArguments

    args_class = type("Args", (TrainingArguments,), {})  # patched alone: TrainingArguments stays as is
    ledger = script.Ledger(ScriptChanges(changes, str(tmp_path)), Knobs(model="m", eval_enabled=False))
    script.patches(ledger)["transformers.training_args"](types.SimpleNamespace(TrainingArguments=args_class))
    args = args_class(
        output_dir=str(tmp_path), eval_strategy="steps", eval_steps=5, save_strategy="steps", save_steps=10,
        load_best_model_at_end=True, lr_scheduler_type="reduce_lr_on_plateau",
    )  # fmt: skip
    assert (args.eval_strategy, args.load_best_model_at_end) == ("steps", True)
    assert unapplied(ledger.settings) == ("eval_enabled",)
    past = PastAttempt(Knobs(model="m"), None, 0, unapplied=unapplied(ledger.settings))
    assert "disable_eval" in unusable_rungs([past])
