"""Bounded input (issue 29 item 4): ``qlora-supervise`` refuses a job file or tool config that is too
large, nested too deep or holds too many values, quickly, in words, exit 2, no traceback. The real
process where its CPU time and memory are measured; ``main()`` in-process where the words are the point."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from _cli import cli

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import _job

#: Runs the CLI in-process and reports the process's peak RSS, so a test can bound the memory.
MEASURED = (
    "import resource, sys\n"
    "from qlora_supervise.supervisor.commands.cli import main\n"
    "try:\n"
    "    code = main(sys.argv[1:])\n"
    "except SystemExit as stop:\n"
    "    code = stop.code\n"
    "usage = resource.getrusage(resource.RUSAGE_SELF)\n"
    "print(f'cpu_s={usage.ru_utime + usage.ru_stime:.2f}', file=sys.stderr)\n"
    # VmHWM: this process's own peak since its exec (ru_maxrss also counts the parent's at the fork)
    "hwm = open('/proc/self/status').read().split('VmHWM:')[1].split()[0]\n"
    "print(f'maxrss_kb={hwm}', file=sys.stderr)\n"
    "sys.exit(code)\n"
)


def _deep_flow(levels: int) -> str:
    return "[" * levels + "]" * levels


def _deep_block(levels: int) -> str:
    return "\n" + "".join("  " * (i + 1) + f"k{i}:\n" for i in range(levels)) + "  " * (levels + 1) + "v: 1\n"


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("nested", [_deep_flow(600), _deep_block(200)], ids=["flow-600", "block-200"])
def test_a_job_file_nested_hundreds_deep_is_refused_in_words(
    tmp_path: Path, command: str, nested: str
) -> None:
    """A job file with a value nested 600 (flow) or 200 (block) levels deep: exit 2 naming the depth."""
    job = _job(tmp_path, {"default": "ok"})
    job.write_text(job.read_text() + "notes:" + (" " + nested if nested.startswith("[") else nested))
    done = cli(command, str(job))
    assert done.returncode == 2, done.stdout + done.stderr
    said = done.stdout + done.stderr
    assert "nested too deep" in said and "more than 32 levels" in said
    assert "Traceback" not in said and "RecursionError" not in said
    assert not (tmp_path / "run").exists()


def test_a_12_mb_job_file_is_refused_fast_with_memory_bounded_and_a_true_message(tmp_path: Path) -> None:
    """A 12.8 MB job file (no aliases): exit 2 in seconds of CPU, under 150 MB, naming its size."""
    job = _job(tmp_path, {"default": "ok"})
    with job.open("a") as handle:
        for i in range(165_000):
            handle.write(f"k{i:06d}: [{i}, {i + 1}, padding padding padding padding padding padding pad]\n")
    assert job.stat().st_size > 12_000_000
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", MEASURED, "validate", str(job)], capture_output=True, text=True, timeout=120
    )
    took = time.monotonic() - start
    assert done.returncode == 2, done.stderr
    size = f"{job.stat().st_size / 1e6:.1f} MB"
    assert "the file is too large" in done.stdout and size in done.stdout and "alias" not in done.stdout
    rss_kb = int(done.stderr.rsplit("maxrss_kb=", 1)[1])
    cpu_s = float(done.stderr.rsplit("cpu_s=", 1)[1].split()[0])
    # CPU time, not wall time, bounds the work on a shared machine (before: 73-135 s and 1.1 GB).
    assert cpu_s < 10 and rss_kb < 150_000, (cpu_s, took, rss_kb, done.stdout[-500:])


def test_many_values_within_the_size_limit_are_refused_as_too_many_not_as_aliases(tmp_path: Path) -> None:
    """20000 values in 110 KB (no alias anywhere): the message counts values and says nothing of aliases."""
    job = _job(tmp_path, {"default": "ok"})
    job.write_text(job.read_text() + "notes: [" + ", ".join(str(i) for i in range(20_000)) + "]\n")
    done = cli("validate", str(job))
    assert done.returncode == 2
    assert "too many values" in done.stdout and "alias" not in done.stdout


@pytest.mark.parametrize("shape", ["deep", "large"])
def test_a_tool_config_too_deep_or_too_large_is_refused_in_words(tmp_path: Path, shape: str) -> None:
    """trainer.config nested 600 deep or 300 KB: validate and run exit 2 naming trainer.config."""
    config = tmp_path / "sft.yaml"
    if shape == "deep":
        config.write_text("model_name_or_path: ./model\nextra: " + _deep_flow(600) + "\n")
    else:
        config.write_text("model_name_or_path: ./model\n" + "".join(f"# {i:0100d}\n" for i in range(3000)))
    job = tmp_path / "job.yaml"
    job.write_text(
        yaml.safe_dump({"trainer": {"kind": "trl-sft", "config": "sft.yaml"}, "output_dir": "run"})
    )
    for command in ("validate", "run"):
        done = cli(command, str(job))
        said = done.stdout + done.stderr
        assert done.returncode == 2, said
        assert "trainer.config" in said and ("nested too deep" in said or "the file is too large" in said)
        assert "Traceback" not in said


@pytest.mark.parametrize("where", ["data record", "model config.json"])
def test_json_nested_thousands_deep_in_the_data_or_the_model_config_is_refused_in_words(
    tmp_path: Path, where: str
) -> None:
    """A data record or a config.json nested 100000 deep: validate and plan exit 2, no RecursionError."""
    job = _job(tmp_path, {"default": "ok"})
    deep = "[" * 100_000 + "]" * 100_000
    if where == "data record":
        with (tmp_path / "data.jsonl").open("a") as handle:
            handle.write('{"text": ' + deep + "}\n")
    else:
        (tmp_path / "model" / "config.json").write_text('{"model_type": "llama", "x": ' + deep + "}")
    for command in ("validate", "plan"):
        done = cli(command, str(job))
        said = done.stdout + done.stderr
        assert done.returncode == 2, said[-2000:]
        assert "nested thousands of levels deep" in said or "nested too deep to read" in said
        assert "Traceback" not in said and "RecursionError" not in said
