"""Bad input refused loudly, before any attempt (issue 11, items 8-11 and 14): ``qlora-supervise
validate`` (its ``main()``, in-process: test_job runs the real process) on job files a user could write."""

from __future__ import annotations

import json
import struct
import subprocess
import time
from pathlib import Path

import pytest
from _cli import cli

from qlora_supervise.supervisor.jobfile import JobError, load_job

JOB = "model: {path: ./model}\ndata: {path: ./data.jsonl}\n"


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    """A model directory with a safetensors header of a two-layer Llama, and five good records."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    for layer in range(2):
        for leaf in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"):
            names.append(f"model.layers.{layer}.{leaf}.weight")
        names.append(f"model.layers.{layer}.input_layernorm.weight")
    header = {name: {"dtype": "F32", "shape": [8, 8], "data_offsets": [0, 0]} for name in names}
    raw = json.dumps(header).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    rows = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(5))
    (tmp_path / "data.jsonl").write_text(rows + "\n")
    return tmp_path


def validate(job: Path) -> subprocess.CompletedProcess[str]:
    return cli("validate", str(job))


def write(job_dir: Path, text: str) -> Path:
    path = job_dir / "job.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("line", "where"),
    [
        ('{"text": "ok"\n', "line 3: not valid JSON"),
        (b'{"text": "caf\xe9"}\n', "line 3: not UTF-8 (byte 0xe9 at column 14)"),
        ('{"text": null}\n', "line 3, field 'text': null, expected text"),
        ('{"text": 42}\n', "line 3, field 'text': number, expected text"),
        ('{"body": "x"}\n', "line 3, field 'text': missing"),
    ],
    ids=["broken-json", "non-utf8", "null", "wrong-type", "missing-field"],
)
def test_bad_record_mid_file_is_named_by_file_line_and_field(
    job_dir: Path, line: str | bytes, where: str
) -> None:
    """Item 8: validate reads the whole dataset and names file, line and field of a bad record mid-file."""
    good = [json.dumps({"text": f"row {i}"}).encode() + b"\n" for i in range(6)]
    bad = line if isinstance(line, bytes) else line.encode()
    (job_dir / "data.jsonl").write_bytes(b"".join(good[:2]) + bad + b"".join(good[2:]))
    result = validate(write(job_dir, JOB))
    assert result.returncode == 2, result.stdout
    assert f"data.path: data.jsonl {where}" in result.stdout, result.stdout


def test_validate_counts_records_not_lines(job_dir: Path) -> None:
    """Item 8: blank lines are no records: five records and a trailing blank line say 5 records."""
    result = validate(write(job_dir, JOB))
    assert result.returncode == 0, result.stdout
    assert "(5 records, text_field 'text')" in result.stdout


def test_a_memory_size_without_a_unit_is_refused_with_the_fix(job_dir: Path) -> None:
    """Item 9: gpu_memory_limit: 24 is not 24 bytes: validate refuses it and says to write 24GiB."""
    result = validate(write(job_dir, JOB + "resources: {gpu_memory_limit: 24, cpu_memory_limit: '8'}\n"))
    assert result.returncode == 2, result.stdout
    assert "resources.gpu_memory_limit: bad byte size: 24 has no unit" in result.stdout
    assert "24GiB" in result.stdout and "8GiB" in result.stdout
    assert load_job(write(job_dir, JOB + "resources: {gpu_memory_limit: 24GiB}\n")).resources.gpu_memory_limit


def test_target_modules_matching_no_tensor_are_caught_by_validate(job_dir: Path) -> None:
    """Item 10: target_modules are checked against the safetensors header's tensor names, no torch."""
    result = validate(write(job_dir, JOB + "lora: {target_modules: [q_proj, query_key_value]}\n"))
    assert result.returncode == 2, result.stdout
    line = next(line for line in result.stdout.splitlines() if "lora.target_modules" in line)
    assert "'query_key_value' match no layer" in line and "q_proj" in line and "o_proj" in line
    assert validate(write(job_dir, JOB + "lora: {target_modules: [q_proj, v_proj]}\n")).returncode == 0


def test_a_billion_laughs_job_file_is_refused_fast(job_dir: Path) -> None:
    """Item 11: nine levels of ten aliases (10**9 values) are refused in well under a second, not minutes."""
    lines = [JOB.strip(), 'x0: &x0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"x{i}: &x{i} [{', '.join([f'*x{i - 1}'] * 10)}]" for i in range(1, 10)]
    started = time.monotonic()
    result = validate(write(job_dir, "\n".join(lines) + "\n"))
    assert time.monotonic() - started < 10
    assert result.returncode == 2
    assert "YAML aliases refused: its aliases expand to more than 10000 values" in result.stdout


def test_a_few_aliases_are_still_fine(job_dir: Path) -> None:
    """Item 11: an alias used as people do (one shared value) is accepted."""
    text = "model: {path: ./model}\ndata: {path: &d ./data.jsonl, eval_path: *d}\n"
    assert load_job(write(job_dir, text)).data.eval_path is not None


def test_trust_remote_code_is_a_warning_in_validate(job_dir: Path) -> None:
    """Item 14: validate passes a trust_remote_code job but says, as a warning, that its code will run."""
    result = validate(
        write(job_dir, "model: {path: ./model, trust_remote_code: true}\ndata: {path: ./data.jsonl}\n")
    )
    assert result.returncode == 0, result.stdout
    assert "warning: model.trust_remote_code is true" in result.stdout
    assert "warning" not in validate(write(job_dir, JOB)).stdout


def test_bad_record_problem_is_a_job_error_in_process(job_dir: Path) -> None:
    """Item 8: the same check runs inside load_job (run refuses the job with exit 2 before any attempt)."""
    (job_dir / "data.jsonl").write_text('{"text": "a"}\n{"text": ["not", "text"]}\n')
    with pytest.raises(JobError, match=r"data.jsonl line 2, field 'text': list, expected text"):
        load_job(write(job_dir, JOB))
