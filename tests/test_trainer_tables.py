"""The knob -> key tables of the foreign trainers, read and written as each tool spells them."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from qlora_supervise.policies.rungs import RUNG_NAMES
from qlora_supervise.supervisor.trainers import flags
from qlora_supervise.supervisor.trainers.mapping import (
    assign,
    attempt_config,
    config_diff,
    config_problems,
    knobs_from,
    lookup,
    unmapped_changes,
)
from qlora_supervise.supervisor.trainers.tool import RUNG_KNOBS, rungs_for
from qlora_supervise.supervisor.trainers.tools import TOOLS
from qlora_supervise.supervisor.trainers.tools.trl_sft import LAUNCH_KEYS as TRL_LAUNCH_KEYS
from qlora_supervise.supervisor.trainers.tools.trl_sft import TABLE as TRL_SFT

TABLES = {kind: tool.table for kind, tool in TOOLS.items()}

USER = {
    "model_name_or_path": "/models/tiny",
    "dataset_name": "/data/set",
    "use_peft": True,
    "per_device_train_batch_size": 16,
    "gradient_accumulation_steps": 2,
    "max_length": 2048,
    "lora_r": 64,
    "my_own_key": {"nested": [1, 2]},
}


def test_knobs_read_the_users_keys_and_the_tools_defaults() -> None:
    """Keys the user wrote become knobs; absent ones take trl's own defaults."""
    knobs = knobs_from(TRL_SFT, USER)
    assert (knobs.micro_batch_size, knobs.grad_accum, knobs.effective_batch) == (16, 2, 32)
    assert (knobs.max_seq_len, knobs.lora_r, knobs.lora_alpha) == (2048, 64, 32)
    assert knobs.gradient_checkpointing is True and knobs.optimizer == "adamw_torch_fused"
    assert knobs.model == "/models/tiny" and knobs.eval_enabled is False


def test_attempt_config_changes_only_what_the_ladder_changed_and_passes_the_rest() -> None:
    """Micro-batch 16 -> 8 writes per_device_train_batch_size 8 and accumulation 4; unknown keys stay."""
    job = knobs_from(TRL_SFT, USER)
    knobs = dataclasses.replace(job, micro_batch_size=8, grad_accum=4, gradient_checkpointing=False)
    out = attempt_config(TRL_SFT, USER, job, knobs, "/run/trainer-output", "/run/checkpoints/checkpoint-4")
    assert out["per_device_train_batch_size"] == 8 and out["gradient_accumulation_steps"] == 4
    assert out["gradient_checkpointing"] is False
    assert out["my_own_key"] == {"nested": [1, 2]} and out["lora_r"] == 64
    assert "optim" not in out  # unchanged and absent: left to trl's default
    assert out["output_dir"] == "/run/trainer-output"
    assert out["resume_from_checkpoint"] == "/run/checkpoints/checkpoint-4"
    assert USER["per_device_train_batch_size"] == 16  # the user's config is not touched
    assert config_diff(USER, out) == [
        "per_device_train_batch_size: 16 -> 8",
        "gradient_accumulation_steps: 2 -> 4",
        "gradient_checkpointing: (absent) -> false",
        "output_dir: (absent) -> '/run/trainer-output'",
        "resume_from_checkpoint: (absent) -> '/run/checkpoints/checkpoint-4'",
    ]


def test_a_fresh_start_removes_the_resume_key() -> None:
    """No checkpoint to resume from: the key is left out, not written as a path."""
    job = knobs_from(TRL_SFT, USER)
    assert "resume_from_checkpoint" not in attempt_config(TRL_SFT, USER, job, job, "/o", None)


def test_dotted_keys_reach_nested_values() -> None:
    """A nested key (axolotl's bnb_config_kwargs.*) is read and written in place."""
    config: dict[str, Any] = {"bnb_config_kwargs": {"llm_int8_threshold": 6.0}}
    assign(config, "bnb_config_kwargs.bnb_4bit_quant_type", "fp4")
    assert config == {"bnb_config_kwargs": {"llm_int8_threshold": 6.0, "bnb_4bit_quant_type": "fp4"}}
    assert lookup(config, "bnb_config_kwargs.bnb_4bit_quant_type") == "fp4"


@pytest.mark.parametrize(
    ("key", "value", "words"),
    [
        ("auto_find_batch_size", True, "the effective batch changes"),
        ("resume_from_checkpoint", "out/checkpoint-9", "set by the supervisor"),
        ("save_strategy", "no", "every restart would begin at step 0"),
        ("use_peft", False, "not a LoRA fine-tune"),
        ("save_only_model", True, "without optimizer state"),
        ("deepspeed", "ds.json", "not supervised yet"),
        ("num_processes", 4, "not supervised yet"),
        ("accelerate_config", "zero2", "not supervised yet"),
        ("per_device_train_batch_size", 0, "whole number > 0"),
        ("gradient_checkpointing", "yes", "expected a bool"),
    ],
)
def test_keys_that_fight_the_ladder_are_named_with_the_fix(key: str, value: Any, words: str) -> None:
    """Each contradicting or malformed key is one problem naming the key, the value and a fix."""
    problems = config_problems(TRL_SFT, {**USER, key: value}, "trainer.config")
    assert [p.path for p in problems] == [f"trainer.config: {key}"]
    assert words in problems[0].problem + problems[0].fix


def test_a_config_without_model_or_peft_is_refused() -> None:
    """model_name_or_path and use_peft are required, each with its fix."""
    problems = config_problems(TRL_SFT, {"dataset_name": "x"}, "trainer.config")
    assert {p.path for p in problems} == {"trainer.config: model_name_or_path", "trainer.config: use_peft"}


def test_every_rung_is_classed_for_the_foreign_tools() -> None:
    """A new rung must say which knob it changes before a foreign tool's ladder can use it."""
    assert set(RUNG_KNOBS) == set(RUNG_NAMES)


def test_trl_takes_the_rungs_its_config_can_express_only() -> None:
    """Our child's own features (bf16 head, activation offload, merge) are not trl's rungs."""
    rungs = rungs_for(TRL_SFT)
    assert {"halve_micro_batch", "gradient_checkpointing", "paged_8bit_optimizer", "shorten_seq_len"} <= rungs
    assert not rungs & {"bf16_head", "activation_offload", "merge_on_cpu", "smaller_model", "drop_rank"}
    job = knobs_from(TRL_SFT, USER)
    assert unmapped_changes(TRL_SFT, USER, job, dataclasses.replace(job, bf16_head=True)) == ["bf16_head"]


def test_flags_read_and_write_like_hfargumentparser() -> None:
    """``--key value``, ``--key=value`` and a bare ``--flag`` read as a config and write back in place."""
    argv = [
        "python",
        "train.py",
        "--per_device_train_batch_size",
        "4",
        "--lr=3e-4",
        "--gradient_checkpointing",
    ]
    config, problems = flags.parse(argv)
    assert problems == [] and config == {
        "per_device_train_batch_size": 4,
        "lr": 3e-4,
        "gradient_checkpointing": True,
    }
    out = flags.with_flags(
        argv, {"per_device_train_batch_size": 2, "gradient_checkpointing": False, "x": None}
    )
    assert out == [
        "python",
        "train.py",
        "--per_device_train_batch_size",
        "2",
        "--lr=3e-4",
        "--gradient_checkpointing",
        "false",
    ]


_TRL_PARSE = """
import dataclasses, json, sys
from trl import DatasetMixtureConfig, ModelConfig, ScriptArguments, SFTConfig, TrlParser
parser = TrlParser((ScriptArguments, SFTConfig, ModelConfig, DatasetMixtureConfig))
parsed = parser.parse_args_and_config(["--config", sys.argv[1]], fail_with_unknown_args=False)
defaults = {f.name: f.default for cls in (SFTConfig, ModelConfig) for f in dataclasses.fields(cls)}
plain = (int, float, str, bool, type(None))
values = {}
for part in parsed[:3]:
    values.update({k: v for k, v in vars(part).items() if isinstance(v, plain)})
print(json.dumps({"values": values, "defaults": {k: v for k, v in defaults.items() if isinstance(v, plain)}}))
"""


@pytest.mark.slow  # imports trl in a subprocess (~5 s)
def test_trl_reads_the_attempt_config_as_the_table_says(tmp_path: Path) -> None:
    """trl's own TrlParser reads each mapped key of an attempt config as the knob; defaults agree."""
    job = knobs_from(TRL_SFT, USER)
    knobs = dataclasses.replace(
        job,
        micro_batch_size=4,
        grad_accum=8,
        gradient_checkpointing=False,
        optimizer="paged_adamw_8bit",
        max_seq_len=1024,
        lora_r=32,
        lora_alpha=64,
        load_in_4bit=True,
        quant_type="fp4",
        double_quant=True,
        eval_batch_size=2,
    )
    config = attempt_config(TRL_SFT, {**USER, "bf16": False}, job, knobs, str(tmp_path / "out"), None)
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    done = subprocess.run(
        [sys.executable, "-c", _TRL_PARSE, str(tmp_path / "sft.yaml")],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    parsed = json.loads(done.stdout.strip().splitlines()[-1])
    values, defaults = parsed["values"], parsed["defaults"]
    expected = dataclasses.asdict(knobs)
    for row in TRL_SFT.rows:
        assert row.read(values[row.key]) == expected[row.knob], row.key
        if row.knob != "model":
            assert defaults[row.key] == row.default, f"trl's default of {row.key} changed"
    assert values["output_dir"] == str(tmp_path / "out")
    for key in (TRL_SFT.resume_key, *(c.key for c in TRL_SFT.contradictions)):
        # each is a field trl knows, or an argument trl's CLI hands to accelerate launch
        assert key in values or key in ("deepspeed", "fsdp", *TRL_LAUNCH_KEYS), key


def test_every_kind_but_ours_has_a_table() -> None:
    """Each kind the trainer section accepts but ours is a registered tool whose table is its own."""
    from qlora_supervise.supervisor.trainers.job import KINDS

    assert ("own", *TOOLS) == KINDS
    assert all(tool.kind == tool.table.kind == kind for kind, tool in TOOLS.items())


AXOLOTL_USER = {
    "base_model": "/models/tiny",
    "adapter": "qlora",
    "load_in_4bit": True,
    "lora_r": 16,
    "lora_alpha": 32,
    "datasets": [{"path": "/data/set", "type": "alpaca"}],
}


@pytest.mark.parametrize(
    ("change", "refused"),
    [
        ({}, False),
        ({"load_in_4bit": False}, True),
        ({"load_in_4bit": None}, True),
        ({"load_in_4bit": False, "adapter": "lora"}, False),
        ({"load_in_4bit": False, "merge_lora": True}, False),
    ],
)
def test_axolotl_qlora_without_4bit_is_named_at_validate(change: dict[str, Any], refused: bool) -> None:
    """axolotl refuses adapter: qlora unless load_in_4bit is true; validate says so before a card is taken."""
    config = {key: value for key, value in {**AXOLOTL_USER, **change}.items() if value is not None}
    problems = config_problems(TABLES["axolotl"], config, "trainer.config")
    named = [p for p in problems if "load_in_4bit" in p.problem]
    assert bool(named) is refused
    if refused:
        assert named[0].path == "trainer.config: adapter" and "set load_in_4bit: true" in named[0].fix


def test_axolotl_batch_size_is_refused_for_the_accumulation_it_means() -> None:
    """axolotl 0.19 trains ``batch_size: 16, micro_batch_size: 2`` at accumulation 1 (its schema
    defaults gradient_accumulation_steps to 1 before its CLI would derive 8; older versions derived
    it): validate asks for the accumulation written out, alone or beside it."""
    table = TABLES["axolotl"]
    for extra in ({}, {"gradient_accumulation_steps": 4}):
        problems = config_problems(
            table, {**AXOLOTL_USER, "batch_size": 16, "micro_batch_size": 2, **extra}, "c"
        )
        assert [p.path for p in problems] == ["c: batch_size"]
        assert "write gradient_accumulation_steps" in problems[0].fix
    assert knobs_from(table, {**AXOLOTL_USER, "micro_batch_size": 2}).grad_accum == 1


@pytest.mark.parametrize("kind", ["trl-sft", "axolotl", "llamafactory"])
@pytest.mark.parametrize("key", ["save_strategy", "eval_strategy"])
def test_an_unquoted_no_read_by_yaml_as_false_is_named(kind: str, key: str) -> None:
    """``save_strategy: no`` is ``False`` to YAML; every tool stops at load on it. Quoted it passes."""
    config = {**USER, **AXOLOTL_USER, "model_name_or_path": "/m", "do_train": True, "stage": "sft"}
    table = TABLES[kind]
    named = [p for p in config_problems(table, {**config, key: False}, "c") if p.path == f"c: {key}"]
    assert len(named) == 1 and '"no" (quoted)' in named[0].fix
    assert not [p for p in config_problems(table, {**config, key: "no"}, "c") if "a bool" in p.problem]


def test_yes_and_no_flags_stay_words_and_bool_flags_read_them_as_argparse_does() -> None:
    """``--save_strategy no`` is the string a str field gets; ``--gradient_checkpointing no`` is False."""
    config, problems = flags.parse(
        ["python", "t.py", "--save_strategy", "no", "--eval_strategy", "no", "--gradient_checkpointing", "no"]
    )
    assert problems == [] and config["save_strategy"] == "no"
    table = TABLES["hf-script"]
    knobs = knobs_from(table, {**config, "output_dir": "o"})
    assert knobs.gradient_checkpointing is False and knobs.eval_enabled is False
    named = config_problems(table, {**config, "output_dir": "o"}, "c")
    assert [p.path for p in named] == ["c: save_strategy"]  # no checkpoints: the ladder's own refusal


@pytest.mark.parametrize(
    ("change", "evaluates"),
    [
        ({}, False),
        ({"val_set_size": 0}, False),
        ({"val_set_size": 0.05}, True),
        ({"test_datasets": [{}]}, True),
    ],
)
def test_axolotl_evaluates_only_with_a_validation_split_or_test_datasets(
    change: dict[str, Any], evaluates: bool
) -> None:
    """axolotl's val_set_size defaults to 0 (no eval): the plan then has no eval phase to count."""
    assert knobs_from(TABLES["axolotl"], {**AXOLOTL_USER, **change}).eval_enabled is evaluates


def test_a_quoted_number_is_read_where_the_tool_reads_it_and_refused_where_it_does_not() -> None:
    """trl (argparse types its config) and axolotl (pydantic coerces) train ``"4"`` as 4;
    LLaMA-Factory's dataclasses keep the string, so validate names it there."""
    assert not config_problems(TRL_SFT, {**USER, "per_device_train_batch_size": "4"}, "c")
    assert knobs_from(TRL_SFT, {**USER, "per_device_train_batch_size": "4"}).micro_batch_size == 4
    axolotl = TABLES["axolotl"]
    assert knobs_from(axolotl, {**AXOLOTL_USER, "micro_batch_size": "2"}).micro_batch_size == 2
    lf = {"model_name_or_path": "/m", "do_train": True, "per_device_train_batch_size": "4"}
    named = config_problems(TABLES["llamafactory"], lf, "c")
    assert [p.path for p in named] == ["c: per_device_train_batch_size"]


#: Evaluation and the best model at the end, as each TrainingArguments tool spells them (hf-script: flags).
_BEST = ["--eval_strategy", "steps", "--eval_steps", "5", "--save_strategy", "steps", "--save_steps", "10"]
_EVAL_OFF_KINDS = ("trl-sft", "llamafactory", "hf-script")


def _eval_off_attempt(kind: str, extra: list[str], tmp_path: Path) -> tuple[Any, list[str]]:
    """The attempt of ``kind`` whose ladder turned evaluation off: its config (hf-script: its argv
    after the script) and its diff lines, as status reads them."""
    from qlora_supervise.supervisor.trainers.trainer import ToolTrainer, read_diff

    command = ("python", "train.py", "--model_name_or_path", "/m", "--output_dir", "o", *_BEST, *extra)
    config, _ = flags.parse(command)
    config |= {} if kind == "hf-script" else {"use_peft": True, "do_train": True}
    path = None if kind == "hf-script" else tmp_path / "user.yaml"
    trainer = ToolTrainer(TOOLS[kind], config, path, command if path is None else ())
    (tmp_path / "run").mkdir(parents=True)
    job = knobs_from(TABLES[kind], config)
    argv = trainer.attempt_argv(
        tmp_path, tmp_path / "run", job, dataclasses.replace(job, eval_enabled=False), None
    )
    attempt = list(argv[2:]) if path is None else yaml.safe_load(Path(argv[-1]).read_text())
    return attempt, read_diff(tmp_path) or []


@pytest.mark.parametrize("kind", _EVAL_OFF_KINDS)
def test_turning_eval_off_turns_load_best_model_at_end_off_in_the_attempt(kind: str, tmp_path: Path) -> None:
    """TrainingArguments refuses the best model at the end without eval: the attempt that turns eval
    off turns it off too and its diff says so; a config without it gets none."""
    attempt, diff = _eval_off_attempt(kind, ["--load_best_model_at_end"], tmp_path)
    config = flags.parse(["t.py", *attempt])[0] if kind == "hf-script" else attempt
    assert (config["eval_strategy"], config["load_best_model_at_end"]) == ("no", False)
    assert "eval_strategy: 'steps' -> 'no'" in diff and "load_best_model_at_end: true -> false" in diff
    attempt, diff = _eval_off_attempt(kind, [], tmp_path / "none")
    assert "load_best_model_at_end" not in str(attempt) and not [d for d in diff if "best" in d]


_TRAINING_ARGUMENTS = """
import json, sys
from transformers import HfArgumentParser, Seq2SeqTrainingArguments, TrainingArguments
for kind, attempt in json.loads(sys.argv[1]):  # llamafactory's TrainingArguments: Seq2Seq's __post_init__
    parser = HfArgumentParser(Seq2SeqTrainingArguments if kind == "llamafactory" else TrainingArguments)
    if isinstance(attempt, list):
        args = parser.parse_args_into_dataclasses(attempt, return_remaining_strings=True)[0]
    else:
        args = parser.parse_dict(attempt, allow_extra_keys=True)[0]
    print(kind, args.eval_strategy.value, args.load_best_model_at_end)
"""


@pytest.mark.slow  # imports transformers in a subprocess (~10 s)
def test_transformers_builds_the_eval_off_attempts_with_the_best_model_at_end(tmp_path: Path) -> None:
    """Each tool's TrainingArguments builds the attempt with eval off (it raised on the mismatch before)."""
    attempts = [
        [k, _eval_off_attempt(k, ["--load_best_model_at_end"], tmp_path / k)[0]] for k in _EVAL_OFF_KINDS
    ]
    done = subprocess.run(
        [sys.executable, "-c", _TRAINING_ARGUMENTS, json.dumps(attempts)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[-4:-1] == [f"{kind} no False" for kind in _EVAL_OFF_KINDS]


@pytest.mark.parametrize("kind", _EVAL_OFF_KINDS)
@pytest.mark.parametrize("scheduler", ["reduce_lr_on_plateau", "greedy"])
def test_a_scheduler_that_needs_eval_takes_disable_eval_off_the_tools_ladder(
    kind: str, scheduler: str
) -> None:
    """TrainingArguments refuses these schedulers with eval off: the eval ladder stops at its batch;
    axolotl never turns eval off (val_set_size is read only)."""
    from qlora_supervise.supervisor.trainers.trainer import ToolTrainer
    from qlora_supervise.trainer_child.contract.codes import FailureKind

    command = ("python", "train.py", "--model_name_or_path", "/m", *_BEST, "--lr_scheduler_type", scheduler)
    config = flags.parse(command)[0]
    trainer = ToolTrainer(TOOLS[kind], config, None, command)
    assert "disable_eval" in trainer.cannot_take() and "disable_eval" in rungs_for(TABLES[kind])
    assert trainer.ladders({})[FailureKind.OOM_EVAL] == ("halve_eval_batch",)
    assert "disable_eval" in rungs_for(TABLES[kind], {**config, "lr_scheduler_type": "cosine"})
    assert "disable_eval" not in rungs_for(
        TABLES["axolotl"], {"val_set_size": 0.1, "lr_scheduler": scheduler}
    )
