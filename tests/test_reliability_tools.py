"""Issue 29's tool items: a tool's refusal is a config error, an extended run keeps its schedule,
host OOM kills after progress, the console as a best-effort output, the tool's config as the job.

Real processes throughout: the scripted child for the loop's rules (seconds), small scripts for
the stderr rules, and the real trainer (ours, ``trl sft``) on the tiny model where only it shows
the behaviour (marked slow).
"""

from __future__ import annotations

import io
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.diagnosis.classify import classify_exit, classify_text
from qlora_supervise.supervisor.facts.failure import ChildExit
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.trainer_child.contract.codes import FailureKind, Stage

sys.path.insert(0, str(Path(__file__).parent))
from _child import capped_job
from _trainer_configs import trl_job
from run_scripted import scripted_seams
from test_loop import _job as loop_job


def _run(job: Path) -> int:
    return run_job(str(job), plain=True, console=io.StringIO(), install_signals=False)


def _run_scripted(job: Path) -> int:
    return run_job(str(job), plain=True, seams=scripted_seams(), console=io.StringIO(), install_signals=False)


def _events(run: Path, name: str) -> list[dict[str, Any]]:
    return [e for e in read_events(run / "events.jsonl") if e["event"] == name]


# -- item 5 / 10: a tool's refusal before its first step is a config error, tried once -------

_ARGPARSE = """usage: sft.py [-h] [--max_steps MAX_STEPS] [--learning_rate LEARNING_RATE]
sft.py: error: argument --max_steps/--max-steps: invalid int value: 'ten'
"""
_OPTIM = """Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/trl/scripts/sft.py", line 167, in <module>
    script_args, training_args, model_args, dataset_args = parser.parse_args_and_config()
  File "/venv/lib/python3.11/site-packages/transformers/training_args.py", line 1563, in __post_init__
    self.optim = OptimizerNames(self.optim)
ValueError: adamw_nonsense is not a valid OptimizerNames, please select one of ['adamw_torch']
"""
_CPU = _OPTIM.replace(
    "ValueError: adamw_nonsense is not a valid OptimizerNames, please select one of ['adamw_torch']",
    "ValueError: Your setup doesn't support bf16/gpu. You need to assign use_cpu if you want to train "
    "the model on CPU.",
)
_MID_TRAINING = """Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/transformers/trainer.py", line 3800, in training_step
    loss = self.compute_loss(model, inputs)
ValueError: Expected input batch_size (4) to match target batch_size (3).
"""


def _exit(code: int) -> ChildExit:
    return ChildExit(returncode=code, signal=None, killed_by_supervisor=None, duration_s=3.0)


def test_a_refusal_at_setup_is_the_configs_with_the_tools_own_line() -> None:
    """argparse's refusal (exit 2), a ValueError in setup frames, trl's CPU refusal (with its fix):
    config_error with the tool's line; the same text mid-training, after a heartbeat in forward,
    argparse's words without its exit status, or behind a CUDA error: not the config's."""
    parser = classify_exit(_exit(2), None, _ARGPARSE)
    assert parser.kind is FailureKind.CONFIG_ERROR
    assert parser.message == "sft.py: error: argument --max_steps/--max-steps: invalid int value: 'ten'"
    assert classify_exit(_exit(1), None, _ARGPARSE).kind is FailureKind.OTHER
    optim = classify_exit(_exit(1), None, _OPTIM)
    assert optim.kind is FailureKind.CONFIG_ERROR and optim.stage is Stage.SETUP
    assert optim.message.startswith("ValueError: adamw_nonsense is not a valid OptimizerNames")
    cpu = classify_exit(_exit(1), None, _CPU)
    assert cpu.kind is FailureKind.CONFIG_ERROR and "use_cpu: true and bf16: false" in cpu.evidence
    assert classify_exit(_exit(1), None, _MID_TRAINING).kind is FailureKind.OTHER
    after_steps = classify_exit(_exit(1), None, _OPTIM, last_stage=Stage.FORWARD, last_step=40)
    assert after_steps.kind is FailureKind.OTHER
    cuda = _OPTIM.replace("ValueError: adamw", "RuntimeError: CUDA error: an illegal memory access\nx")
    assert classify_exit(_exit(1), None, cuda).kind is not FailureKind.CONFIG_ERROR
    # classify_text, for any command's log, keeps its corpus labels.
    assert {classify_text(t).kind for t in (_ARGPARSE, _OPTIM, _CPU)} == {FailureKind.OTHER}


class SafetensorError(Exception):
    """Stands in for safetensors' own class (matched by name: the child need not import it)."""


def test_the_childs_rule_marks_refusals_before_the_first_step_and_nothing_after() -> None:
    """capture(): a TypeError at load (learning_rate: [1, 2] at the optimizer's construction) and a
    model file safetensors refuses are CONFIG; the same in forward, a damaged resume checkpoint and
    a load short of GPU memory keep their own codes."""
    from qlora_supervise.trainer_child.contract.checkpoints import CheckpointLoadError
    from qlora_supervise.trainer_child.contract.codes import ExitCode
    from qlora_supervise.trainer_child.run.failure import capture

    lr = TypeError("'<=' not supported between instances of 'float' and 'list'")
    assert capture(lr, Stage.LOAD, 0).exit_code is ExitCode.CONFIG
    header = SafetensorError("Error while deserializing header: incomplete metadata")
    assert capture(header, Stage.LOAD, 0).exit_code is ExitCode.CONFIG
    assert capture(lr, Stage.FORWARD, 3).exit_code is ExitCode.FAILED
    damaged = CheckpointLoadError("checkpoint-4: cannot load its adapter")
    assert capture(damaged, Stage.LOAD, 0).exit_code is ExitCode.CHECKPOINT
    short = ValueError("Some modules are dispatched on the CPU or the disk. Make sure you have enough GPU")
    assert capture(short, Stage.LOAD, 0).exit_code is ExitCode.FAILED


_TOOL = """import argparse, sys
parser = argparse.ArgumentParser(prog="tool.py")
parser.add_argument("--output_dir")
parser.add_argument("--max_steps", type=int)
args, _ = parser.parse_known_args()
if args.max_steps == 13:
    raise ValueError("max_steps 13 is unlucky: choose another")
"""


def _tool_job(tmp_path: Path, max_steps: str) -> Path:
    """An hf-script job running ``tool`` as a module from a folder named site-packages (where a
    tool's own frames are), with ``--max_steps max_steps``."""
    site = tmp_path / "site-packages"
    site.mkdir(parents=True)
    (site / "tool.py").write_text(_TOOL)
    command = [sys.executable, "-m", "tool", "--output_dir", "out", "--max_steps", max_steps]
    job = {
        "trainer": {"kind": "hf-script", "command": command},
        "resources": {"gpu": "cpu"},
        "supervise": {"backoff_initial": "0.1s", "backoff_max": "1s"},
        "output_dir": "./run",
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


@pytest.mark.parametrize(
    ("value", "line"),
    [
        ("ten", "tool.py: error: argument --max_steps: invalid int value: 'ten'"),
        ("13", "ValueError: max_steps 13 is unlucky: choose another"),
    ],
)
def test_a_tool_that_refuses_its_arguments_stops_after_one_attempt(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, value: str, line: str
) -> None:
    """A real tool process refusing its argument (argparse, exit 2) or raising a ValueError from its
    own frames before any step: one attempt, exit 4, the tool's line as the failure's message."""
    job = _tool_job(tmp_path, value)
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site-packages"))
    assert _run(job) == 4
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert [r.outcome for r in records] == ["failed"] and records[0].failure is not None
    assert records[0].failure.kind == "config_error" and records[0].failure.message == line


@pytest.mark.slow
@pytest.mark.parametrize(
    ("keys", "line"),
    [
        ({"max_steps": "ten"}, "sft.py: error: argument --max_steps/--max-steps: invalid int value: 'ten'"),
        ({"learning_rate": [1, 2]}, "TypeError: '<=' not supported between instances of 'float' and 'list'"),
        ({"optim": "adamw_nonsense"}, "ValueError: adamw_nonsense is not a valid OptimizerNames"),
    ],
)
def test_trl_refusing_its_config_is_a_config_error_tried_once(
    tiny_dir: Path, tmp_path: Path, keys: dict[str, Any], line: str
) -> None:
    """trl sft itself refusing a value (its argument parser, its optimizer's construction inside
    train(), transformers' TrainingArguments): one attempt, exit 4, trl's own line as the message."""
    job = trl_job(tiny_dir, tmp_path, capped=False, **keys)
    assert _run(job) == 4
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert [r.outcome for r in records] == ["failed"] and records[0].failure is not None
    assert records[0].failure.kind == "config_error" and records[0].failure.message.startswith(line)


@pytest.mark.slow
def test_trl_on_the_cpu_names_the_fix_and_the_edited_config_lifts_the_verdict(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """trl's default bf16 on a machine without a GPU: config_error after one attempt naming
    use_cpu: true and bf16: false; the user writes them into the tool's config, and the same
    run command lifts the verdict (a change of the job) and trains to the end."""
    job = trl_job(tiny_dir, tmp_path, capped=False, max_steps=2)
    config = yaml.safe_load((tmp_path / "sft.yaml").read_text())
    del config["bf16"]  # trl's default: true
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    assert _run(job) == 4
    run = tmp_path / "run"
    records, _ = read_attempts(run / "attempts.jsonl")
    assert len(records) == 1 and records[0].failure is not None
    assert records[0].failure.kind == "config_error"
    assert "You need to assign use_cpu" in records[0].failure.message
    assert "use_cpu: true and bf16: false" in records[0].failure.evidence
    config.update(use_cpu=True, bf16=False)
    (tmp_path / "sft.yaml").write_text(yaml.safe_dump(config))
    assert _run(job) == 0
    (changed,) = _events(run, "job_changed")
    assert set(changed["changes"]) == {"trainer.config.use_cpu", "trainer.config.bf16"}
    (lifted,) = _events(run, "verdict_lifted")
    assert lifted["verdict"] == "failed"
    records, _ = read_attempts(run / "attempts.jsonl")
    assert [r.outcome for r in records] == ["failed", "succeeded"] and records[1].steps_completed == 2


@pytest.mark.slow
def test_a_model_file_that_does_not_load_is_a_config_error_tried_once(tiny_dir: Path, tmp_path: Path) -> None:
    """Our trainer on a model.safetensors cut short (its header reads, so validate passes; the
    load fails): one attempt, exit 4, safetensors' own line and the fix (download it again)."""
    model = tmp_path / "model"
    shutil.copytree(tiny_dir / "model", model)
    weights = model / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 1000)
    job = capped_job(tiny_dir, tmp_path, max_steps=2, save_steps=2)
    raw = yaml.safe_load(job.read_text())
    raw["model"]["path"] = str(model)
    raw["resources"].pop("cpu_memory_limit")
    job.write_text(yaml.safe_dump(raw))
    assert _run(job) == 4
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert [r.outcome for r in records] == ["failed"] and records[0].failure is not None
    failure = records[0].failure
    assert failure.kind == "config_error" and failure.message.startswith("SafetensorError")
    assert "download the model again" in failure.evidence


def test_the_tools_own_keys_are_part_of_the_job_and_apply_while_nothing_was_trained() -> None:
    """A trl config's keys the supervisor does not read are trainer.config.<key> in the job's view
    (its mapped keys stay the job's fields); a change of one applies while the run trained no step
    and needs --restart after; a view recorded before tool keys were kept shows no change for them."""
    from qlora_supervise.supervisor.record.generations import FieldChange, diff
    from qlora_supervise.supervisor.trainers.tools import trl_sft
    from qlora_supervise.supervisor.trainers.trainer import ToolTrainer

    config = {"model_name_or_path": "/m", "per_device_train_batch_size": 4, "max_steps": 3, "use_cpu": True}
    config["lora_target_modules"] = ["q_proj"]
    unread = ToolTrainer(trl_sft.TOOL, config, Path("sft.yaml")).unread_keys()
    assert unread == {"use_cpu": True}
    assert FieldChange("trainer.config.use_cpu", None, True, untrained=True).safe
    assert not FieldChange("trainer.config.use_cpu", None, True).safe
    assert not FieldChange("trainer.config.learning_rate", 1e-4, 2e-4).safe
    old = {"lora.r": 8}
    new = {"lora.r": 8, "trainer.config": "sft.yaml", "trainer.config.use_cpu": True}
    assert diff(old, new) == []
    assert [c.name for c in diff({**old, "trainer.config": "sft.yaml"}, new)] == ["trainer.config.use_cpu"]


# -- item 8: an extended run continues its schedule as a run of the new length would ----------


def _cosine(step: int, total: int, base: float) -> float:
    """transformers' cosine schedule without warmup at ``step`` of ``total``."""
    return base * 0.5 * (1.0 + math.cos(math.pi * step / total))


@pytest.mark.slow
def test_an_extended_run_trains_its_first_new_step_on_the_new_schedule_not_at_lr_0(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """max_steps 2 -> 4 on a finished cosine run: step 3, its first new step, trains at the 4-step
    schedule's rate at step 2 (half the peak), not at the 2-step schedule's end (0)."""
    job = capped_job(tiny_dir, tmp_path, max_steps=2, save_steps=2, lr_scheduler="cosine", warmup_ratio=0.0)
    raw = yaml.safe_load(job.read_text())
    raw["resources"].pop("cpu_memory_limit")  # no OOM wanted here
    raw["train"].update(micro_batch_size=2, effective_batch_size=4, max_seq_len=64)
    job.write_text(yaml.safe_dump(raw))
    base = float(raw["train"]["learning_rate"])
    assert _run(job) == 0
    raw["train"]["max_steps"] = 4
    job.write_text(yaml.safe_dump(raw))
    assert _run(job) == 0
    run = tmp_path / "run"
    records, _ = read_attempts(run / "attempts.jsonl")
    assert [(r.outcome, r.resumed_from, r.steps_completed) for r in records] == [
        ("succeeded", 0, 2),
        ("succeeded", 2, 4),
    ]
    lines = (run / "attempt-002" / "child-events.jsonl").read_text().splitlines()
    (resumed,) = [e for e in map(json.loads, lines) if e.get("event") == "resumed"]
    assert resumed["from_step"] == 2
    assert resumed["learning_rate"] == pytest.approx(_cosine(2, 4, base), rel=1e-6)
    # The trainer's own log names the rate each step trained at: step k at the schedule's k - 1.
    state = json.loads((run / "checkpoints" / "checkpoint-4" / "trainer_state.json").read_text())
    logged = {e["step"]: e["learning_rate"] for e in state["log_history"] if "learning_rate" in e}
    assert logged[3] == pytest.approx(_cosine(2, 4, base), rel=1e-6)
    assert logged[4] == pytest.approx(_cosine(3, 4, base), rel=1e-6)


# -- item 7: a host OOM kill after progress is not "in a row" ---------------------------------


def test_two_host_oom_kills_with_five_good_steps_between_them_keep_the_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Killed by the kernel at step 4, then at step 9 after 5 good steps past the first kill: both
    retried unchanged (no rung, the rank kept), and the run finishes; a kill at the same step
    again is the config's own peak and walks the ladder's first throughput rung."""
    events = tmp_path / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    monkeypatch.setenv("QLORA_SUPERVISE_CGROUP_MEMORY_EVENTS", str(events))
    monkeypatch.setenv("SCRIPTED_CHILD_OOM_EVENTS", str(events))
    apart = tmp_path / "apart"
    apart.mkdir()
    assert _run_scripted(loop_job(apart, {"1": "sigkill@4", "2": "sigkill@9"}, train={"save_steps": 2})) == 0
    records, _ = read_attempts(apart / "run" / "attempts.jsonl")
    assert [(r.outcome, r.steps_completed) for r in records] == [
        ("failed", 3),
        ("failed", 8),
        ("succeeded", 10),
    ]
    assert all(r.failure is not None and r.failure.kind == "host_oom" for r in records[:2])
    assert [r.decision.rung if r.decision else None for r in records[:2]] == ["retry_unchanged"] * 2
    assert records[0].knobs == records[1].knobs == records[2].knobs
    same_step = tmp_path / "same"
    same_step.mkdir()
    events.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    assert (
        _run_scripted(loop_job(same_step, {"1": "sigkill@4", "2": "sigkill@4"}, train={"save_steps": 2})) == 0
    )
    records, _ = read_attempts(same_step / "run" / "attempts.jsonl")
    assert [r.decision.rung if r.decision else None for r in records] == [
        "retry_unchanged",
        "gradient_checkpointing",
        None,
    ]
    assert records[2].knobs.lora_r == records[0].knobs.lora_r


# -- item 10: the console is a best-effort output ----------------------------------------------

_SCRIPTED = Path(__file__).with_name("run_scripted.py")


@pytest.mark.parametrize("piped", ["stdout", "stdout and stderr"])
def test_ctrl_c_under_tee_exits_130_and_journals_the_stop(tmp_path: Path, piped: str) -> None:
    """``run job.yaml | tee log`` and Ctrl-C (SIGINT to the whole process group, so tee dies
    first): exit 130 (not 141), the stop journaled, the state stopped."""
    job = loop_job(tmp_path, {"default": "ok"}, train={"max_steps": 40})
    redirect = "2>&1" if piped == "stdout and stderr" else "2>/dev/null"
    command = (
        f"{sys.executable} {_SCRIPTED} --cli run {job} --plain {redirect} | tee {tmp_path / 'log'}; "
        f"echo ${{PIPESTATUS[0]}} > {tmp_path / 'status'}"
    )
    shell = subprocess.Popen(
        ["bash", "-c", command],
        cwd=tmp_path,
        start_new_session=True,  # its own process group: the terminal's Ctrl-C goes to all of it
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "SCRIPTED_CHILD_STEP_S": "0.1"},  # 4 s for the 40 steps: stopped mid-run
    )
    child_events = tmp_path / "run" / "attempt-001" / "child-events.jsonl"
    deadline = time.monotonic() + 120
    while not (child_events.is_file() and '"heartbeat"' in child_events.read_text()):
        assert time.monotonic() < deadline and shell.poll() is None, "the child never trained a step"
        time.sleep(0.05)
    os.killpg(shell.pid, signal.SIGINT)
    shell.wait(timeout=120)
    assert (tmp_path / "status").read_text().strip() == "130"
    run = tmp_path / "run"
    records, _ = read_attempts(run / "attempts.jsonl")
    assert [r.outcome for r in records] == ["stopped"] and records[0].next_resume_from is not None
    assert json.loads((run / "state.json").read_text())["run_state"] == "stopped"
    # The console's loss is logged once when a log line met it (stderr in the pipe); stdout's
    # summary comes after the last event, so only its exit status shows it there.
    lost = [e for e in _events(run, "output_failed") if e["output"] == "console"]
    assert len(lost) == (1 if piped == "stdout and stderr" else 0), lost
    assert all("Broken pipe" in e["problem"] for e in lost)
