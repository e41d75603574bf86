"""A foreign trainer's plan and retries use only the rungs its config can express."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_loop_fake_clock import LLAMA2_7B

from qlora_supervise.policies.decide import PastAttempt, Restart, decide
from qlora_supervise.policies.rungs import rungs_between
from qlora_supervise.supervisor.commands.plan import make_plan
from qlora_supervise.supervisor.loop.planner import first_plan
from qlora_supervise.supervisor.loop.settings import policy_settings
from qlora_supervise.supervisor.trainers.job import load_job
from qlora_supervise.supervisor.trainers.mapping import unmapped_changes
from qlora_supervise.supervisor.trainers.trainer import ToolTrainer, UnmappedKnobsError
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage


@dataclasses.dataclass(frozen=True)
class _Failure:
    kind: FailureKind
    stage: Stage = Stage.FORWARD
    numbers: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    fatal_xid: int | None = None


def _trl_7b_job(tmp_path: Path, cap: str = "12GiB", **keys: Any) -> Path:
    """A trl sft job of the Llama-2-7B shape on a capped card, as a user would write it."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA2_7B))
    config = {
        "model_name_or_path": str(tmp_path / "model"),
        "dataset_name": "/srv/data/instructions",
        "use_peft": True,
        "load_in_4bit": True,
        "lora_r": 8,
        "lora_alpha": 16,
        "per_device_train_batch_size": 8,
        "gradient_accumulation_steps": 2,
        "gradient_checkpointing": False,
        "max_length": 2048,
        "optim": "adamw_torch",
        "max_steps": 100,
        "output_dir": "./out",
        **keys,
    }
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    job = {
        "trainer": {"kind": "trl-sft", "config": "sft.yaml"},
        "resources": {"gpu": 0, "gpu_memory_limit": cap},
        "supervise": {"calibration_store": False},
        "output_dir": str(tmp_path / "run"),
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


def test_the_retry_search_after_an_oom_uses_only_the_tools_rungs(tmp_path: Path) -> None:
    """After a forward OOM of a trl 7B job on 12 GiB, each restart (also at micro-batch 1) changes
    only knobs trl's config has keys for: no bf16 head, no activation offload."""
    job = load_job(_trl_7b_job(tmp_path))
    assert isinstance(job.trainer, ToolTrainer)
    settings = policy_settings(job)
    assert {"bf16_head", "activation_offload"} <= settings.cannot_take
    allowed = job.trainer.rungs()
    knobs, history = job.knobs, []
    for _ in range(4):
        history.append(PastAttempt(knobs, FailureKind.OOM_FORWARD, 0, stage=Stage.FORWARD))
        out = decide(_Failure(FailureKind.OOM_FORWARD), knobs, history, settings)
        if not isinstance(out, Restart):
            break
        assert set(out.rung.split("+")) <= allowed, out.rung
        assert unmapped_changes(job.trainer.tool.table, job.trainer.config, job.knobs, out.knobs) == []
        knobs = out.knobs
    assert knobs != job.knobs


def test_the_first_plan_of_a_foreign_job_searches_without_what_the_tool_cannot_take(tmp_path: Path) -> None:
    """Pre-flight of a trl 7B job that does not fit 6 GiB (where our trainer would offload
    activations) searches again with trl's own rungs and starts from a config predicted to fit."""
    job = load_job(_trl_7b_job(tmp_path, "6GiB"))
    assert isinstance(job.trainer, ToolTrainer)
    settings = policy_settings(job)
    plan = first_plan(job.knobs, settings, job.train.target_modules, False, job.resources.device)
    assert plan.knobs != job.knobs and plan.nothing_fits is None
    assert set(rungs_between(job.knobs, plan.knobs)) <= job.trainer.rungs()
    assert plan.note is not None and not plan.note.as_written


def test_the_attempt_config_writer_refuses_a_knob_the_tool_has_no_key_for(tmp_path: Path) -> None:
    """A bf16 head reaching trl's per-attempt config is an internal error, never a silent drop."""
    job = load_job(_trl_7b_job(tmp_path))
    assert isinstance(job.trainer, ToolTrainer) and "bf16_head" in job.trainer.cannot_take()
    knobs = dataclasses.replace(job.knobs, bf16_head=True, micro_batch_size=4, grad_accum=4)
    (tmp_path / "attempt").mkdir()
    with pytest.raises(UnmappedKnobsError, match="bf16_head"):
        job.trainer.attempt_argv(tmp_path / "attempt", tmp_path / "run", job.knobs, knobs, None)
    assert not (tmp_path / "attempt" / "trl-sft.yaml").exists()


def test_plan_agrees_with_run_and_lists_only_the_tools_rungs(tmp_path: Path) -> None:
    """``qlora-supervise plan`` of the trl 7B job on 6 GiB starts from the config run would start
    from, ranks only trl's rungs and omits the rungs trl cannot take from its rung list."""
    path = _trl_7b_job(tmp_path, "6GiB")
    job = load_job(path)
    assert isinstance(job.trainer, ToolTrainer)
    allowed = job.trainer.rungs()
    plan = make_plan(str(path), None)
    start = first_plan(job.knobs, policy_settings(job), job.train.target_modules, False, job.resources.device)
    assert plan["start"] is not None and plan["start"]["knobs"] == dataclasses.asdict(start.knobs)
    assert {rung["name"] for rung in plan["rungs"]} <= allowed
    assert {"gradient_checkpointing", "halve_micro_batch"} <= {rung["name"] for rung in plan["rungs"]}
    assert all(set(candidate["rungs"]) <= allowed for candidate in plan["ranking"])


def test_a_relative_model_path_is_read_from_the_tools_workdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``model_name_or_path: ../models/m`` is the model beside the config's folder for the memory
    model and plan, whatever the supervisor's cwd; the attempt's config keeps it as written."""
    (tmp_path / "models").mkdir()
    _trl_7b_job(tmp_path / "models")  # its model/ is tmp/models/model
    (tmp_path / "cfg").mkdir()
    _trl_7b_job(tmp_path / "cfg", model_name_or_path="../models/model")
    (tmp_path / "elsewhere" / "deeper").mkdir(parents=True)  # ../models/model is nothing from here
    monkeypatch.chdir(tmp_path / "elsewhere" / "deeper")
    job = load_job(tmp_path / "cfg" / "job.yaml")
    assert isinstance(job.trainer, ToolTrainer) and job.knobs.model == str(tmp_path / "models" / "model")
    assert policy_settings(job).shape is not None
    assert make_plan(str(tmp_path / "cfg" / "job.yaml"), None)["shape"] is not None
    knobs = dataclasses.replace(job.knobs, micro_batch_size=4, grad_accum=4)
    (tmp_path / "attempt").mkdir()
    (tmp_path / "run").mkdir()
    job.trainer.attempt_argv(tmp_path / "attempt", tmp_path / "run", job.knobs, knobs, None)
    written = yaml.safe_load((tmp_path / "attempt" / "trl-sft.yaml").read_text())
    assert written["model_name_or_path"] == "../models/model"
