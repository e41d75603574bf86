"""The trainer child trains the tiny model on the CPU through the real 4-bit QLoRA path."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _child import events, log_tail, make_spec, next_spec, report, run_child

from qlora_supervise.trainer_child.contract.codes import ExitCode
from qlora_supervise.trainer_child.contract.spec import Knobs

pytestmark = pytest.mark.slow
#: trainer.TEST_TRACE_BATCHES (not imported: that module imports torch into the test process).
TEST_TRACE_BATCHES = "QLORA_SUPERVISE_TEST_TRACE_BATCHES"


def test_tiny_job_trains_to_completion_and_loss_falls(tiny_dir: Path, tmp_path: Path) -> None:
    """Twelve steps through 4-bit layers and paged_adamw_8bit finish, write an adapter; the loss falls."""
    spec = make_spec(tiny_dir, tmp_path, train={"max_steps": 12, "save_steps": 6})
    assert spec.knobs.optimizer == Knobs(model="m").optimizer == "paged_adamw_8bit"
    assert run_child(spec) == ExitCode.OK, log_tail(spec)
    seen = events(spec)
    loaded = next(e for e in seen if e["event"] == "loaded")
    assert loaded["linear4bit"] > 0 and 0 < loaded["trainable_share"] < 0.5
    by_step = {e["step"]: e["loss"] for e in seen if e["event"] == "heartbeat" and e["step"] > 0}
    assert sorted(by_step) == list(range(1, 13))
    assert by_step[12] < by_step[1] - 1.0, by_step  # from ln(vocab) ~ 6.9 towards the digits' entropy
    steps = [e["step"] for e in seen if e["event"] == "checkpoint_saved"]
    assert steps == [6, 12]
    finished = next(e for e in seen if e["event"] == "finished")
    assert finished["step"] == 12
    assert (Path(spec.adapter_dir) / "adapter_model.safetensors").is_file()
    started = next(e for e in seen if e["event"] == "started")
    assert started["vmdata"] > 0 and started["expandable_segments_active"] is None  # CPU: not applicable

    merge = next_spec(spec, knobs={"merge_on_cpu": True})
    assert run_child(merge, module="qlora_supervise.trainer_child.merge.process") == ExitCode.OK, log_tail(
        merge
    )
    assert (Path(spec.merged_dir) / "config.json").is_file()
    assert not list(Path(spec.merged_dir).glob("adapter_*"))


def test_messages_field_is_rendered_with_the_chat_template(tiny_dir: Path, tmp_path: Path) -> None:
    """A chat dataset trains two steps, every row rendered by the tokenizer's chat template."""
    trace = tmp_path / "batches.jsonl"
    spec = make_spec(
        tiny_dir,
        tmp_path,
        data={"text_field": None, "messages_field": "messages"},
        train={"max_steps": 2, "save_steps": 100},
    )
    assert run_child(spec, **{TEST_TRACE_BATCHES: str(trace)}) == ExitCode.OK, log_tail(spec)
    seen = events(spec)
    assert sorted({e["step"] for e in seen if e["event"] == "heartbeat" and e["step"] > 0}) == [1, 2]
    assert next(e for e in seen if e["event"] == "finished")["step"] == 2
    words = _vocabulary(tiny_dir)
    rows = [ids for line in trace.read_text().splitlines() for ids in json.loads(line)["input_ids"]]
    assert len(rows) == 2 * spec.knobs.effective_batch  # both steps' rows were traced
    for ids in rows:  # the template's role tags, never the raw JSON of the messages
        tokens = [words[i] for i in ids]
        assert tokens[0] == "<|user|>" and "<|assistant|>" in tokens, tokens[:8]


def _vocabulary(tiny: Path) -> dict[int, str]:
    """Token id -> token of the tiny word-level tokenizer, read from its JSON (no torch here)."""
    saved = json.loads((tiny / "model" / "tokenizer.json").read_text())
    words = {index: token for token, index in saved["model"]["vocab"].items()}
    words.update({added["id"]: added["content"] for added in saved["added_tokens"]})
    return words


def test_chat_data_puts_the_loss_on_the_assistant_turns_only(tiny_dir: Path, tmp_path: Path) -> None:
    """With messages_field, every token of the user's turn is labelled -100; the assistant's are trained."""
    trace = tmp_path / "batches.jsonl"
    spec = make_spec(
        tiny_dir,
        tmp_path,
        data={"text_field": None, "messages_field": "messages"},
        train={"max_steps": 1, "save_steps": 100},
    )
    assert run_child(spec, **{TEST_TRACE_BATCHES: str(trace)}) == ExitCode.OK, log_tail(spec)
    words = _vocabulary(tiny_dir)
    batches = [json.loads(line) for line in trace.read_text().splitlines()]
    rows = [pair for batch in batches for pair in zip(batch["input_ids"], batch["labels"], strict=True)]
    assert len(rows) == spec.knobs.effective_batch
    for ids, labels in rows:
        tokens = [words[i] for i in ids]
        turn = tokens.index("<|assistant|>")
        assert tokens[0] == "<|user|>" and "count" in tokens[:turn], tokens[:turn]
        assert set(labels[: turn + 1]) == {-100}  # the user's turn and the assistant's role tag
        assert labels[turn + 1 :] == ids[turn + 1 :]  # the answer (truncated to 128: no padding)
        assert len(ids) - turn - 1 > 64  # most of the row is trained


def test_target_modules_matching_nothing_is_a_config_error(tiny_dir: Path, tmp_path: Path) -> None:
    """target_modules that match no layer exit 71 with a report listing the model's linear layers."""
    spec = make_spec(tiny_dir, tmp_path, train={"target_modules": ("query_key_value",)})
    assert run_child(spec) == ExitCode.CONFIG, log_tail(spec)
    failure = report(spec)
    assert failure.config_error and failure.stage == "load" and not failure.is_oom
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in failure.message


def test_missing_text_field_is_a_config_error(tiny_dir: Path, tmp_path: Path) -> None:
    """A text field the dataset lacks exits 71 naming the field and the columns it has."""
    spec = make_spec(tiny_dir, tmp_path, data={"text_field": "prompt"})
    assert run_child(spec) == ExitCode.CONFIG, log_tail(spec)
    assert "'prompt'" in report(spec).message and "messages" in report(spec).message
