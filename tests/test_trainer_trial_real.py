"""The speed trial in a foreign tool's own process, run by the shim on its Trainer (tiny model,
CPU): trl sft, axolotl (in its venv, tests/_tool_venvs.py), and a script it cannot time.

The attempt is prepared as the supervisor prepares one (``resume.write_spec``: the attempt's
``trl-sft.yaml`` and its spec, with three candidates the pre-flight would hand a GPU attempt; on
the CPU the pre-flight has no budget to rank by, so the test names them), then trl's script is
started with the shim as the runner starts it (``trainers.trainer.trainer_env``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml
from _machine import scaled
from _resume_checks import read_lines
from _tool_venvs import AXOLOTL, tool_python
from _trainer_configs import axolotl_config, text_dataset, trl_job

from qlora_supervise.policies.choice import after_trial
from qlora_supervise.supervisor.loop.child import Seams, child_argv
from qlora_supervise.supervisor.loop.planner import Plan
from qlora_supervise.supervisor.loop.resume import ResumePoint, write_spec
from qlora_supervise.supervisor.record.history import read_attempt_speed
from qlora_supervise.supervisor.record.journal import Phase
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.supervisor.trainers import trainer as tool_trainer
from qlora_supervise.supervisor.trainers.job import load_job
from qlora_supervise.trainer_child.contract.events import SpeedTrialEvent, parse_event
from qlora_supervise.trainer_child.contract.spec import Knobs, TrialCandidate

pytestmark = pytest.mark.slow

TRACE = "QLORA_SUPERVISE_TEST_TRACE_BATCHES"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "trainers"
#: Effective batch 16 each: the config as written (2 x 8, checkpointed), and two larger micro-batches
#: without checkpointing (on this machine kind ~40 % faster: the trial switches).
CANDIDATES = (TrialCandidate(2, 8, True), TrialCandidate(4, 4, False), TrialCandidate(8, 2, False))
STEPS = 3


def _trl_attempt(tiny_dir: Path, out: Path, trial: tuple[TrialCandidate, ...], **keys: Any) -> Path:
    """Attempt 1 of a trl-sft job (by default CANDIDATES[0]'s knobs, seq 128) in trl's process; its
    events file."""
    config = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 8,
              "gradient_checkpointing": True, "max_length": 128, "max_steps": STEPS, "save_steps": 100,
              **keys}  # fmt: skip
    return _attempt(trl_job(tiny_dir, out, capped=False, **config), trial)


def _attempt(job_file: Path, trial: tuple[TrialCandidate, ...]) -> Path:
    """Run attempt 1 of a foreign job with ``trial`` in its spec, as the runner would; its events file."""
    job = load_job(job_file)
    out = job_file.parent
    rd = RunDir(out / "run")
    rd.root.mkdir()
    plan = Plan(Phase.TRAIN, job.knobs, speed_trial=trial)
    spec = write_spec(job, rd, 1, plan, ResumePoint(0, None, False), Seams(), structlog.get_logger())
    spec_path = rd.attempt_dir(1) / "spec.json"
    env = tool_trainer.trainer_env({**os.environ, TRACE: str(out / "trace.jsonl")}, spec, spec_path)
    argv = child_argv(spec_path, "train")
    done = subprocess.run(argv, env=env, cwd=out, capture_output=True, text=True, timeout=scaled(600))
    assert done.returncode == 0, done.stderr[-3000:]
    return Path(spec.events_file)


def _trial(events: Path) -> SpeedTrialEvent:
    found = [e for e in read_lines(events) if e["event"] == "speed_trial"]
    assert len(found) == 1
    event = parse_event(json.dumps(found[0]))
    assert isinstance(event, SpeedTrialEvent)
    return event


def _chosen(event: SpeedTrialEvent) -> TrialCandidate:
    """The candidate the policy trains with among the event's timings (every job here plans CANDIDATES[0])."""
    plan = CANDIDATES[0]
    planned = Knobs("m", plan.micro_batch_size, plan.grad_accum, plan.gradient_checkpointing)
    k = after_trial(planned, event.results).knobs
    return TrialCandidate(k.micro_batch_size, k.grad_accum, k.gradient_checkpointing)


def _trained(out: Path) -> list[tuple[int, list[str]]]:
    return [(b["step"], b["rows"]) for b in read_lines(out / "trace.jsonl")]


def _losses(events: Path) -> dict[int, float]:
    beats = [e for e in read_lines(events) if e["event"] == "heartbeat" and e.get("loss") is not None]
    return {e["step"]: e["loss"] for e in beats}


def test_the_shim_times_trls_trainer_and_trl_trains_the_choice_as_if_untimed(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """One speed_trial event in trl's process, a row per candidate; trl then trains the chosen
    micro-batch and checkpointing, the same batches and losses as a run told those knobs outright."""
    events = _trl_attempt(tiny_dir, tmp_path / "trial", CANDIDATES)
    event = _trial(events)
    assert event.abandoned is None and [r.candidate for r in event.results] == list(CANDIDATES)
    assert all(r.tokens_per_s and r.tokens_per_s > 0 and r.error is None for r in event.results)
    chosen = _chosen(event)
    assert chosen != CANDIDATES[0]
    trained = _trained(tmp_path / "trial")
    assert {len(rows) for _, rows in trained} == {chosen.micro_batch_size}
    assert len(trained) == STEPS * chosen.grad_accum
    # What the supervisor journals as the attempt's knobs: the trial's choice.
    planned = load_job(tmp_path / "trial" / "job.yaml").knobs
    knobs = read_attempt_speed(events, planned).knobs
    assert (knobs.micro_batch_size, knobs.grad_accum) == (chosen.micro_batch_size, chosen.grad_accum)
    assert knobs.gradient_checkpointing is chosen.gradient_checkpointing

    plain = _trl_attempt(
        tiny_dir,
        tmp_path / "plain",
        (),
        per_device_train_batch_size=chosen.micro_batch_size,
        gradient_accumulation_steps=chosen.grad_accum,
        gradient_checkpointing=chosen.gradient_checkpointing,
    )
    assert not [e for e in read_lines(plain) if e["event"] == "speed_trial"]
    assert _trained(tmp_path / "plain") == trained
    assert _losses(plain) == pytest.approx(_losses(events), rel=1e-5) and len(_losses(plain)) == STEPS


def test_a_trial_the_tool_cannot_take_keeps_the_plan_and_says_why(tiny_dir: Path, tmp_path: Path) -> None:
    """A script whose Trainer trains on a plain list of tokenized rows (not a ``datasets`` table):
    the trial has no column to find the longest row in, so it is abandoned, saying why, and the
    script trains as planned, in the same process."""
    script = (EXAMPLES / "hf-script" / "train.py").read_text()
    mapped = "rows = rows.map(\n"
    assert mapped in script
    closed = "        remove_columns=rows.column_names,\n    )\n"
    listed = script.replace(mapped, "rows = list(rows.map(\n").replace(closed, closed[:-1] + ")\n")
    assert "rows = list(rows.map(" in listed and "    ))\n" in listed
    (tmp_path / "train.py").write_text(listed)
    data = text_dataset(tiny_dir, tmp_path) / "train.jsonl"
    command = [sys.executable, "train.py", "--model_name_or_path", str(tiny_dir / "model"),
               "--dataset_path", str(data), "--output_dir", "out", "--per_device_train_batch_size", "2",
               "--gradient_accumulation_steps", "8", "--gradient_checkpointing", "true",
               "--max_seq_length", "128", "--max_steps", str(STEPS), "--save_steps", "100",
               "--logging_steps", "1", "--report_to", "none", "--use_cpu", "true"]  # fmt: skip
    trainer = {"kind": "hf-script", "command": command}
    job = {"trainer": trainer, "resources": {"gpu": "cpu"}, "output_dir": "./run"}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    events = _attempt(tmp_path / "job.yaml", CANDIDATES)
    event = _trial(events)
    assert event.abandoned and "no tokenized training row" in event.abandoned
    assert _chosen(event) == CANDIDATES[0] and event.results == ()
    assert {len(rows) for _, rows in _trained(tmp_path)} == {2}
    assert max(_losses(events)) == STEPS


def _axolotl_attempt(tiny_dir: Path, out: Path, **keys: Any) -> Path:
    """Attempt 1 of an axolotl job (2 x 8, checkpointing, seq 128) in axolotl's own venv."""
    out.mkdir(parents=True)
    config = axolotl_config(tiny_dir, out, micro_batch_size=2, gradient_accumulation_steps=8,
                            gradient_checkpointing=True, sequence_len=128, max_steps=STEPS, save_steps=100,
                            **keys)  # fmt: skip
    (out / "axolotl.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
    trainer = {"kind": "axolotl", "config": "axolotl.yaml", "python": str(tool_python(AXOLOTL))}
    job = {"trainer": trainer, "resources": {"gpu": "cpu"}, "output_dir": "./run"}
    (out / "job.yaml").write_text(yaml.safe_dump(job))
    return _attempt(out / "job.yaml", CANDIDATES)


def test_the_shim_times_axolotls_trainer_and_axolotl_trains_the_choice(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In axolotl's process: a row per candidate (its dataset reduced to the columns its Trainer
    keeps), then axolotl trains the chosen micro-batch; with sample_packing the trial keeps the plan."""
    monkeypatch.setenv("AXOLOTL_DO_NOT_TRACK", "1")  # its telemetry would try the network
    events = _axolotl_attempt(tiny_dir, tmp_path / "plain")
    event = _trial(events)
    assert event.abandoned is None and [r.candidate for r in event.results] == list(CANDIDATES)
    assert all(r.tokens_per_s and r.error is None for r in event.results)
    trained = _trained(tmp_path / "plain")
    assert {len(rows) for _, rows in trained} == {_chosen(event).micro_batch_size}
    assert max(_losses(events)) == STEPS

    packed = _axolotl_attempt(tiny_dir, tmp_path / "packed", sample_packing=True, pad_to_sequence_len=True)
    event = _trial(packed)
    assert event.abandoned is not None and "sample_packing" in event.abandoned
    assert _chosen(event) == CANDIDATES[0] and max(_losses(packed)) == STEPS
