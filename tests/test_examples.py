"""The example job files stay valid job files (only their site-specific paths are swapped)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from qlora_supervise.supervisor.jobfile import load_job

EXAMPLES = sorted((Path(__file__).resolve().parents[1] / "examples").glob("*.yaml"))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_example_job_validates_with_local_paths(example: Path, tmp_path: Path) -> None:
    """Every example validates once its model, fallback and data paths point at real files."""
    raw = yaml.safe_load(example.read_text())
    for name in ("model", "small"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"model_type": "llama"}))
    data = tmp_path / "data.jsonl"
    row = {"text": "hi", "messages": [{"role": "user", "content": "hi"}]}
    data.write_text(json.dumps(row) + "\n")
    raw["model"]["path"] = str(tmp_path / "model")
    raw["model"]["fallbacks"] = [str(tmp_path / "small")] if raw["model"].get("fallbacks") else []
    raw["data"]["path"] = str(data)
    raw["output_dir"] = str(tmp_path / "run")
    job_path = tmp_path / "job.yaml"
    job_path.write_text(yaml.safe_dump(raw))
    job = load_job(job_path)
    assert job.knobs.effective_batch == raw["train"]["effective_batch_size"]
