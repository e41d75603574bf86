"""What a warm spare prepares ahead serves only an attempt with the same inputs; the supervisor
names the spec to prepare from without making it part of the spare's match."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from qlora_supervise.supervisor.loop import child as child_mod
from qlora_supervise.supervisor.loop.spare import SpareOrder, spare_argv
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DataSpec, Knobs, TrainSpec
from qlora_supervise.trainer_child.recipe.data import Inputs, Prepared


def _spec(**changes: object) -> AttemptSpec:
    knobs = Knobs(model="/models/m", micro_batch_size=4, grad_accum=4, max_seq_len=2048)
    spec = AttemptSpec(1, "/run", knobs, DataSpec("/d.jsonl"), TrainSpec(), "e", "f", "c", "a", "m")
    return dataclasses.replace(spec, **changes)  # type: ignore[arg-type]


def _prepared(spec: AttemptSpec) -> Prepared:
    return Prepared(Inputs.of(spec), tokenizer=None, train_set=None, eval_set=None, lengths=None, seconds=0.1)


def test_a_rung_does_not_spoil_what_was_prepared() -> None:
    """Every rung changes knobs the tokenizer and rows do not depend on (micro-batch, seq_len,
    checkpointing, optimizer, rank): what attempt 1's spec prepared serves attempt 2."""
    first = _spec()
    rungs = {"micro_batch_size": 1, "grad_accum": 16, "max_seq_len": 1024, "gradient_checkpointing": True}
    knobs = dataclasses.replace(first.knobs, **rungs, lora_r=8)  # type: ignore[arg-type]
    assert _prepared(first).serves(dataclasses.replace(first, attempt=2, knobs=knobs))


def test_other_inputs_are_loaded_afresh() -> None:
    """A smaller model (another tokenizer), other data, another seed or packing: not served."""
    first = _spec()
    ready = _prepared(first)
    smaller = dataclasses.replace(first.knobs, model="/models/smaller")
    assert not ready.serves(dataclasses.replace(first, knobs=smaller))
    assert not ready.serves(dataclasses.replace(first, data=DataSpec("/d.jsonl", eval_fraction=0.1)))
    assert not ready.serves(dataclasses.replace(first, train=TrainSpec(seed=7)))
    assert not ready.serves(dataclasses.replace(first, train=TrainSpec(packing=True)))
    assert not ready.serves(dataclasses.replace(first, train=TrainSpec(trust_remote_code=True)))


def test_the_spare_is_told_which_spec_to_prepare_from(tmp_path: Path) -> None:
    """``--prepare`` names the spec; two orders that differ only there are the same spare."""
    env = child_mod.child_env(dict(os.environ), _spec().knobs)
    spec_path = tmp_path / "attempt-001" / "spec.json"
    order = SpareOrder(env, "auto", True, "/models/m", prepare_from=spec_path)
    argv = spare_argv(tmp_path, order, "python")
    assert argv[argv.index("--prepare") + 1] == str(spec_path)
    assert order == SpareOrder(env, "auto", True, "/models/m", prepare_from=tmp_path / "other.json")
    assert "--prepare" not in spare_argv(tmp_path, SpareOrder(env, "auto", True, "/models/m"), "python")


def test_a_data_file_rewritten_since_the_spare_read_it_is_read_again(tmp_path: Path) -> None:
    """The stamps (size, mtime) of the data and tokenizer files are inputs too; a model's weights
    are not (the tokenizer never reads them)."""
    data = tmp_path / "rows.jsonl"
    data.write_text('{"text": "a"}\n')
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"0")
    spec = _spec(data=DataSpec(str(data)), knobs=dataclasses.replace(_spec().knobs, model=str(model)))
    ready = _prepared(spec)
    assert ready.serves(spec)
    (model / "model.safetensors").write_bytes(b"00")
    assert ready.serves(spec)
    data.write_text('{"text": "a"}\n{"text": "b"}\n')
    assert not ready.serves(spec)
    assert not _prepared(spec).serves(dataclasses.replace(spec, data=DataSpec(str(tmp_path / "gone.jsonl"))))
