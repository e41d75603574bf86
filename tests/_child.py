"""Helpers for the trainer-child tests: the tiny model (built once per session), attempt
specs written directly (no job.yaml parsing) and real child processes."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from _machine import MIB, above_baseline, scaled

from qlora_supervise.trainer_child.contract.report import ErrorReport
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DataSpec, Knobs, TrainSpec

ROOT = Path(__file__).resolve().parents[1]


def shared_dir(tmp_path_factory: pytest.TempPathFactory, name: str, build: list[str]) -> Path:
    """``<run's temp folder>/name``, written once per test run by the command ``build`` (``{dir}`` in
    it: the folder); under pytest-xdist the workers share it, built by whichever needs it first
    while the other waits on the lock. Tests only read it."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's own folder, shared by its workers
    directory = root / name
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (directory / ".built").is_file():
            shutil.rmtree(directory, ignore_errors=True)
            command = [part.replace("{dir}", str(directory)) for part in build]
            subprocess.run(command, check=True, env=child_env(), capture_output=True)
            (directory / ".built").write_text("")
    return directory


@pytest.fixture(scope="session", name="tiny_dir")
def tiny_dir_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, tokenizer and dataset, written once per test run (in a subprocess, so the
    test process itself never imports torch), shared by the xdist workers."""
    tiny = [sys.executable, "-m", "qlora_supervise.trainer_child.recipe.tiny", "{dir}"]
    return shared_dir(tmp_path_factory, "tiny-shared", tiny)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


def make_spec(
    tiny: Path,
    run_dir: Path,
    attempt: int = 1,
    *,
    knobs: dict[str, Any] | None = None,
    train: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    **fields: Any,
) -> AttemptSpec:
    """An attempt on the tiny model: 8 steps of effective batch 8 at seq 128 unless told."""
    attempt_dir = run_dir / f"attempt-{attempt:03d}"
    knob_values = {
        "model": str(tiny / "model"),
        "micro_batch_size": 2,
        "grad_accum": 4,
        "max_seq_len": 128,
        "gradient_checkpointing": False,  # the memory numbers of the OOM tests assume it off
        **(knobs or {}),
    }
    train_values = {
        "max_steps": 8,
        "save_steps": 4,
        "logging_steps": 1,
        "warmup_ratio": 0.0,
        "learning_rate": 2e-3,
        **(train or {}),
    }
    return AttemptSpec(
        attempt=attempt,
        run_dir=str(run_dir),
        knobs=Knobs(**knob_values),
        data=DataSpec(**{"path": str(tiny / "data.jsonl"), **(data or {})}),
        train=TrainSpec(**train_values),
        events_file=str(attempt_dir / "child-events.jsonl"),
        error_file=str(attempt_dir / "error.json"),
        checkpoints_dir=str(run_dir / "checkpoints"),
        adapter_dir=str(run_dir / "adapter"),
        merged_dir=str(run_dir / "merged"),
        device="cpu",
        **{"heartbeat_interval": 1.0, **fields},
    )


def next_spec(spec: AttemptSpec, **changes: Any) -> AttemptSpec:
    """The following attempt with changed knobs (and fields), like a supervisor restart."""
    attempt = spec.attempt + 1
    attempt_dir = Path(spec.run_dir) / f"attempt-{attempt:03d}"
    knobs = dataclasses.replace(spec.knobs, **changes.pop("knobs", {}))
    return dataclasses.replace(
        spec,
        attempt=attempt,
        knobs=knobs,
        events_file=str(attempt_dir / "child-events.jsonl"),
        error_file=str(attempt_dir / "error.json"),
        **changes,
    )


def write_spec(spec: AttemptSpec) -> Path:
    path = Path(spec.events_file).parent / "spec.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(spec.to_json(), encoding="utf-8")
    return path


def start_child(
    spec: AttemptSpec, module: str = "qlora_supervise.trainer_child", **env: str
) -> subprocess.Popen[str]:
    path = write_spec(spec)
    log = open(path.parent / "child.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(
        [sys.executable, "-m", module, "--spec", str(path)],
        cwd=ROOT,
        env=child_env(**env),
        stdout=log,
        stderr=subprocess.STDOUT,
        text=True,
    )


def run_child(
    spec: AttemptSpec, timeout: float | None = None, module: str = "qlora_supervise.trainer_child", **env: str
) -> int:
    """The child's exit code; ``timeout`` (default: 180 s scaled to this machine, generously, see
    ``_machine.scaled``) only bounds a stuck child."""
    child = start_child(spec, module, **env)
    try:
        return child.wait(timeout if timeout is not None else scaled(180))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def events(spec: AttemptSpec) -> list[dict[str, Any]]:
    path = Path(spec.events_file)
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def wait_for_event(
    spec: AttemptSpec, predicate: Any, child: subprocess.Popen[str], timeout: float | None = None
) -> dict[str, Any]:
    timeout = timeout if timeout is not None else scaled(120)  # generous, scaled to this machine
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in events(spec):
            if predicate(event):
                return event
        if child.poll() is not None:
            raise AssertionError(f"child exited {child.returncode} before the event; log: {log_tail(spec)}")
        time.sleep(0.2)
    raise AssertionError(f"no such event within {timeout}s; log: {log_tail(spec)}")


def report(spec: AttemptSpec) -> ErrorReport:
    return ErrorReport.from_json(Path(spec.error_file).read_text())


def log_tail(spec: AttemptSpec, chars: int = 4000) -> str:
    path = Path(spec.events_file).parent / "child.log"
    return path.read_text()[-chars:] if path.exists() else "(no log)"


#: The tiny model at micro-batch 16, seq 512: ~1.7 GiB of data segment without gradient
#: checkpointing, ~1.2 GiB with it (with the CPU build of torch: a 0.37 GiB import baseline);
#: the cap sits between them (a real OOM, then a fix), this far above the measured baseline
#: of the torch installed here (1350 MiB with the CPU build), as the demo places its cap.
CAPPED_HEADROOM = 970 * MIB


def capped_job(
    tiny_dir: Path,
    out: Path,
    *,
    max_steps: int,
    save_steps: int,
    supervise: dict[str, Any] | None = None,
    **train: Any,
) -> Path:
    """``out/job.yaml`` for a supervised run of the tiny model under :data:`CAPPED_HEADROOM` (run dir
    ``out/run``): micro-batch 16 without checkpointing, so the first attempt runs out of memory."""
    import yaml

    job = yaml.safe_load((tiny_dir / "job.yaml").read_text())
    job["model"]["path"] = str(tiny_dir / "model")
    job["data"]["path"] = str(tiny_dir / "data.jsonl")
    job["train"].update(
        micro_batch_size=16,
        effective_batch_size=16,
        gradient_checkpointing=False,
        max_seq_len=512,
        max_steps=max_steps,
        save_steps=save_steps,
        logging_steps=1,
        **train,
    )
    job["resources"] = {"gpu": "cpu", "cpu_memory_limit": f"{above_baseline(CAPPED_HEADROOM)}B"}
    job["supervise"] = {
        "hang_timeout": "5m",
        "backoff_initial": "0.1s",
        "backoff_max": "1s",
        **(supervise or {}),
    }
    job["output_dir"] = str(out / "run")
    out.mkdir(parents=True, exist_ok=True)
    (out / "job.yaml").write_text(yaml.safe_dump(job))
    return out / "job.yaml"
