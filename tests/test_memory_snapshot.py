"""The opt-in OOM snapshot: the job's diagnose section, the spec it crosses in, and status naming the file."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from qlora_supervise.supervisor.commands.status import print_story
from qlora_supervise.supervisor.jobfile.load import JobError, load_job
from qlora_supervise.supervisor.record.journal import AttemptRecord, Outcome, Phase, append_attempt
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract.spec import (
    MEMORY_SNAPSHOT_NAME,
    AttemptSpec,
    DataSpec,
    DiagnoseSpec,
    Knobs,
    TrainSpec,
)


def _job(tmp_path: Path, extra: str) -> Path:
    (tmp_path / "model").mkdir(parents=True)
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (tmp_path / "data.jsonl").write_text('{"text": "a"}\n{"text": "b"}\n')
    path = tmp_path / "job.yaml"
    path.write_text(f"model: {{path: ./model}}\ndata: {{path: ./data.jsonl}}\n{extra}")
    return path


def test_memory_history_is_off_unless_the_job_turns_it_on(tmp_path: Path) -> None:
    """No diagnose section: off; ``diagnose: {memory_history: true}`` turns it on with the bounded default."""
    assert load_job(_job(tmp_path, "")).diagnose == DiagnoseSpec()
    on = load_job(_job(tmp_path / "on", "diagnose: {memory_history: true, memory_history_entries: 5000}\n"))
    assert on.diagnose == DiagnoseSpec(memory_history=True, memory_history_entries=5000)


def test_a_bad_diagnose_section_is_refused_with_its_field_path(tmp_path: Path) -> None:
    """A misspelt key and a zero bound are both reported, with their paths."""
    path = _job(tmp_path, "diagnose: {memory_histroy: true, memory_history_entries: 0}\n")
    with pytest.raises(JobError) as error:
        load_job(path)
    text = str(error.value)
    assert "diagnose.memory_histroy" in text and "diagnose.memory_history_entries" in text


def test_the_diagnose_spec_crosses_to_the_child() -> None:
    """AttemptSpec JSON carries diagnose; a spec written before it reads back with the default."""
    spec = AttemptSpec(1, "/r", Knobs(model="m"), DataSpec(path="d"), TrainSpec(), "e", "err", "c", "a", "m",
                       diagnose=DiagnoseSpec(memory_history=True))  # fmt: skip
    assert AttemptSpec.from_json(spec.to_json()).diagnose.memory_history is True
    raw = json.loads(spec.to_json())
    del raw["diagnose"]
    assert AttemptSpec.from_json(json.dumps(raw)).diagnose == DiagnoseSpec()


def test_status_names_the_snapshot_and_how_to_open_it(tmp_path: Path) -> None:
    """An attempt directory holding the OOM snapshot gets a status line with its path and the viewer."""
    rd = RunDir(tmp_path)
    record = AttemptRecord(1, Phase.TRAIN, Knobs(model="m"), Outcome.FAILED, 0.0, 1.0, 70, None, 0, 0, 0, 0)
    append_attempt(rd.attempts, record)
    out = io.StringIO()
    print_story(rd, out)
    assert MEMORY_SNAPSHOT_NAME not in out.getvalue()
    rd.attempt_dir(1).mkdir(parents=True, exist_ok=True)
    (rd.attempt_dir(1) / MEMORY_SNAPSHOT_NAME).write_bytes(b"\x80\x04N.")
    out = io.StringIO()
    print_story(rd, out)
    text = out.getvalue()
    assert f"memory snapshot: {rd.attempt_dir(1) / MEMORY_SNAPSHOT_NAME}" in text
    assert "https://pytorch.org/memory_viz" in text
