"""The shim's wiring: its environment, its start-up file, and the fallback when it cannot attach."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.commands.status import status_command
from qlora_supervise.supervisor.loop.child import Seams, child_argv
from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.supervisor.trainers import trainer as tool_trainer
from qlora_supervise.trainer_child import shim
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DataSpec, Knobs, TrainSpec


def _spec(command: tuple[str, ...] = ()) -> AttemptSpec:
    return AttemptSpec(
        1, "/run", Knobs(model="m"), DataSpec(path="d"), TrainSpec(), "e", "r", "c", "a", "g", command=command
    )


def test_the_two_sides_name_the_same_variable_and_folder() -> None:
    """The supervisor's copy of the variable name is the shim's; its site folder holds sitecustomize.py."""
    assert tool_trainer.SHIM_SPEC_ENV == shim.SHIM_SPEC_ENV
    assert (tool_trainer.SHIM_SITE / "sitecustomize.py").is_file()


def test_a_foreign_attempt_gets_the_shim_and_its_own_argv(tmp_path: Path) -> None:
    """PYTHONPATH gains the shim (before the user's), the spec is named, no bytecode is written
    beside the user's modules, and the argv is the tool's."""
    spec = _spec(("python", "-m", "trl.scripts.sft", "--config", "/run/attempt-001/trl-sft.yaml"))
    env = tool_trainer.trainer_env({"PYTHONPATH": "/mine"}, spec, tmp_path / "spec.json")
    assert env["PYTHONPATH"] == f"{tool_trainer.SHIM_SITE}{os.pathsep}/mine"
    assert env[tool_trainer.SHIM_SPEC_ENV] == str(tmp_path / "spec.json")
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"  # no __pycache__ in the user's folder
    assert tool_trainer.trainer_env({"PYTHONPATH": "/mine"}, _spec(), tmp_path / "spec.json") == {
        "PYTHONPATH": "/mine"
    }
    (tmp_path / "spec.json").write_text(spec.to_json())
    assert child_argv(tmp_path / "spec.json", "train") == list(spec.command)
    assert AttemptSpec.from_json(spec.to_json()) == spec


def test_the_shim_runs_a_users_own_sitecustomize_too(tmp_path: Path) -> None:
    """Ours shadows the user's sitecustomize on the path; it runs it after itself."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "sitecustomize.py").write_text("print('the user sitecustomize ran')\n")
    env = {**os.environ, "PYTHONPATH": f"{tool_trainer.SHIM_SITE}{os.pathsep}{mine}"}
    env.pop(tool_trainer.SHIM_SPEC_ENV, None)
    done = subprocess.run([sys.executable, "-c", "pass"], env=env, capture_output=True, text=True, timeout=60)
    assert done.stdout.strip() == "the user sitecustomize ran", done.stderr


SCRIPT = """
import os, sys
args = sys.argv[1:]
batch = int(args[args.index("--per_device_train_batch_size") + 1])
if batch > 2:
    sys.stderr.write(
        "Traceback (most recent call last):\\n  File \\"train.py\\", line 9, in training_step\\n"
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity "
        "of 23.55 GiB of which 1.20 GiB is free. Including non-PyTorch memory, this process has 22.30 GiB "
        "memory in use. Of the allocated memory 21.10 GiB is allocated by PyTorch, and 0.80 GiB is reserved "
        "by PyTorch but unallocated.\\n")
    sys.exit(1)
out = args[args.index("--output_dir") + 1]
os.makedirs(out, exist_ok=True)
open(os.path.join(out, "done"), "w").write(" ".join(args))
"""


def _run_script_job(tmp_path: Path, command: list[str]) -> int:
    """``run`` on an hf-script job of ``command`` in ``tmp_path`` (its run in ``./run``), quick backoff."""
    job = {
        "trainer": {"kind": "hf-script", "command": command},
        "resources": {"gpu": "cpu"},
        "supervise": {"backoff_initial": "0.1s", "backoff_max": "1s"},
        "output_dir": "./run",
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return run_job(str(tmp_path / "job.yaml"), plain=True, console=io.StringIO(), install_signals=False)


def test_a_tool_missing_a_package_stops_at_once_as_a_config_error(tmp_path: Path) -> None:
    """A tool whose venv lacks a package dies importing, before our shim attaches (on the H200,
    axolotl 0.19 without posthog's ``backoff``): tried once, exit 4, the import named; not three
    unchanged retries classified as ``other``."""
    (tmp_path / "train.py").write_text("import os, sys\nimport qlora_supervise_missing_backoff\n")
    command = [sys.executable, "train.py", "--output_dir", "out", "--per_device_train_batch_size", "2"]
    assert _run_script_job(tmp_path, command) == 4
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert [(r.outcome, r.failure.kind if r.failure else None) for r in records] == [
        ("failed", "config_error")
    ]
    assert records[0].failure is not None
    assert "No module named 'qlora_supervise_missing_backoff'" in records[0].failure.evidence
    assert "trainer.python" in records[0].failure.evidence


def test_a_script_the_shim_cannot_attach_to_is_classified_from_stderr_and_said_so(tmp_path: Path) -> None:
    """An hf-script that builds no Trainer: OOMs read from stderr, the batch halved, a journal line each."""
    (tmp_path / "train.py").write_text(SCRIPT)
    command = [
        sys.executable,
        "train.py",
        "--output_dir",
        "out",
        "--per_device_train_batch_size",
        "8",
        "--gradient_accumulation_steps",
        "2",
        "--gradient_checkpointing",
    ]
    assert _run_script_job(tmp_path, command) == 0
    run = tmp_path / "run"
    records, _ = read_attempts(run / "attempts.jsonl")
    assert [r.outcome for r in records] == ["failed", "failed", "succeeded"]
    assert all(r.failure is not None and r.failure.kind == "oom_forward" for r in records[:2])
    assert all(
        "no error report; stderr text" in (r.failure.evidence if r.failure else "") for r in records[:2]
    )
    assert [(r.knobs.micro_batch_size, r.knobs.grad_accum) for r in records] == [(8, 2), (4, 4), (2, 8)]
    silent = [e for e in read_events(run / "events.jsonl") if e["event"] == "shim_not_attached"]
    assert [e["attempt"] for e in silent] == [1, 2, 3]
    last = json.loads((run / "attempt-003" / "command.json").read_text())
    assert last[last.index("--per_device_train_batch_size") + 1] == "2"
    assert last[last.index("--output_dir") + 1] == str(run / "trainer-output")
    # Run beside the job file: the relative script path worked; the user's command is unchanged.
    assert (run / "trainer-output" / "done").is_file()
    assert yaml.safe_load((tmp_path / "job.yaml").read_text())["trainer"]["command"] == command
    # Without the shim nothing was written to run/adapter: the log names the tool's own output.
    (done,) = [e for e in read_events(run / "events.jsonl") if e["event"] == "run_succeeded"]
    assert not (run / "adapter").exists()
    assert done["adapter"] is None and done["trainer_output"] == str(run / "trainer-output")
    out = io.StringIO()
    assert status_command([str(run)], out=out) == 0
    saved = f"adapter: none in the run directory; the tool saved into {run / 'trainer-output'}"
    assert saved in out.getvalue()
    raw = io.StringIO()
    assert status_command([str(run)], as_json=True, out=raw) == 0
    shown = json.loads(raw.getvalue())["runs"][0]
    assert shown["adapter"] is None and shown["trainer_output"] == str(run / "trainer-output")


def _script_job(tmp_path: Path, body: str) -> Path:
    tmp_path.mkdir()
    (tmp_path / "train.py").write_text(body)
    command = [sys.executable, "train.py", "--output_dir", "out", "--per_device_train_batch_size", "1"]
    job = {
        "trainer": {"kind": "hf-script", "command": command},
        "resources": {"gpu": "cpu"},
        "supervise": {"hang_timeout": "1.5s", "hang_grace": "1s", "max_attempts": 1},
        "output_dir": "./run",
    }
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    return tmp_path / "job.yaml"


_TALKS = """
import os, sys, time
for i in range(9):  # 2.25 s of output, longer than the job's hang_timeout of 1.5 s
    print(f"step {i}", flush=True)
    time.sleep(0.25)
out = sys.argv[sys.argv.index("--output_dir") + 1]
os.makedirs(out, exist_ok=True)
open(os.path.join(out, "adapter_config.json"), "w").write("{}")
"""
_SILENT = "import time\ntime.sleep(30)\n"


def test_without_the_shim_a_talking_tool_is_no_hang_and_a_silent_one_is(tmp_path: Path) -> None:
    """No heartbeats: output in child.log within hang_timeout is progress; silence past it is a hang."""
    ticks = Seams(tick_s=0.1, stop_grace_s=10)  # the loop looks at the log every 0.1 s, not 0.5 s
    talking = _script_job(tmp_path / "talks", _TALKS)
    assert run_job(str(talking), plain=True, seams=ticks, console=io.StringIO(), install_signals=False) == 0
    silent = _script_job(tmp_path / "silent", _SILENT)
    assert run_job(str(silent), plain=True, seams=ticks, console=io.StringIO(), install_signals=False) == 3
    records, _ = read_attempts(tmp_path / "silent" / "run" / "attempts.jsonl")
    assert records[0].failure is not None and records[0].failure.kind == "hang"


def test_a_tool_that_exits_0_without_saving_anything_has_not_succeeded(tmp_path: Path) -> None:
    """The loop creates trainer-output/ before each attempt: a tool that leaves it empty and exits 0
    has saved nothing, so the attempt is a failure, not a success."""
    job = _script_job(tmp_path / "nothing", "import sys\nprint('done, saved nothing', flush=True)\n")
    assert run_job(str(job), plain=True, console=io.StringIO(), install_signals=False) != 0
    run = tmp_path / "nothing" / "run"
    assert (run / "trainer-output").is_dir() and not any((run / "trainer-output").iterdir())
    records, _ = read_attempts(run / "attempts.jsonl")
    assert [r.outcome for r in records] == ["failed"]
    assert not [e for e in read_events(run / "events.jsonl") if e["event"] == "run_succeeded"]


def test_a_process_the_attempts_trainer_started_does_not_attach_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A data worker that imports transformers.trainer inherits the session's marker: no second
    session (no spec read, no finder), while a process that re-executed itself is still the attempt."""
    from qlora_supervise.trainer_child.shim import attach

    monkeypatch.setenv(attach.SESSION_ENV, str(os.getpid() + 1))
    finders = list(sys.meta_path)
    attach.install(str(tmp_path / "no-such-spec.json"))  # would raise if it read the spec
    assert sys.meta_path == finders
    monkeypatch.setenv(attach.SESSION_ENV, str(os.getpid()))
    assert not attach._started_by_the_attempt()


def test_an_environment_a_launcher_fixed_is_not_fixed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under a launcher that ran the shim first, CUDA_VISIBLE_DEVICES is already the one card:
    binding the device again would fail, so the trainer process skips prepare_env."""
    from qlora_supervise.trainer_child import __main__ as child_main
    from qlora_supervise.trainer_child.shim import attach

    def refuse(spec: object) -> None:
        raise AssertionError("prepare_env ran twice")

    monkeypatch.setenv(attach.SESSION_ENV, "")  # restored after the test, whatever install sets
    monkeypatch.setenv(attach.PREPARED_ENV, "1")
    # Not yet imported, as in a fresh trainer process (another test may have imported it here).
    monkeypatch.delitem(sys.modules, attach.TRAINER_MODULE, raising=False)
    monkeypatch.setattr(child_main, "prepare_env", refuse)
    monkeypatch.setattr(attach.AttemptSpec, "from_json", classmethod(lambda cls, text: object()))
    (tmp_path / "spec.json").write_text("{}")
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the finder it leaves goes with the test
    attach.install(str(tmp_path / "spec.json"))
    assert isinstance(sys.meta_path[0], attach._AfterImport)


def test_a_spec_from_a_newer_supervisor_still_reads() -> None:
    """A shim of an older qlora-supervise in a tool's venv reads a newer supervisor's spec: the
    fields it does not know are left out (else it could not attach at all)."""
    spec = _spec(("python", "-m", "trl.scripts.sft"))
    raw = json.loads(spec.to_json())
    raw["a_field_of_tomorrow"] = 1
    raw["knobs"]["a_knob_of_tomorrow"] = True
    assert AttemptSpec.from_json(json.dumps(raw)) == spec


def test_a_load_error_of_the_config_is_told_from_one_of_the_card() -> None:
    """A ValueError while the tool loads is the config's; one that says the card lacked room for
    the weights (transformers' quantizer under device_map auto) is not; nor is anything in train."""
    from qlora_supervise.trainer_child.contract.codes import Stage
    from qlora_supervise.trainer_child.run.failure import is_the_configs

    assert is_the_configs(ValueError("Either datasets or dataset_name must be provided"), Stage.LOAD)
    assert is_the_configs(ModuleNotFoundError("No module named 'flash_attn'"), Stage.SETUP)
    short = ValueError(
        "Some modules are dispatched on the CPU or the disk. Make sure you have enough GPU RAM"
    )
    assert not is_the_configs(short, Stage.LOAD)
    assert not is_the_configs(RuntimeError("CUDA error: an illegal memory access"), Stage.LOAD)
    assert not is_the_configs(ValueError("bad"), Stage.FORWARD)
