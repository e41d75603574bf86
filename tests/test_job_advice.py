"""Jobs that would train senselessly are refused or warned about at validate, and units do not slip.

Issue 21 items 16 and 17.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from qlora_supervise.supervisor.commands.validate import validate_command
from qlora_supervise.supervisor.exit_codes import SupervisorExit
from qlora_supervise.supervisor.facts.units import UnitError, parse_bytes, parse_memory_size
from qlora_supervise.supervisor.jobfile import JobError, load_job
from qlora_supervise.supervisor.jobfile.advice import job_advice

MODEL = "model: {path: ./model}\n"


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    """A fake model directory and data files of 1, 3 and 40 records."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    for count in (1, 3, 40):
        rows = "".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(count))
        (tmp_path / f"rows{count}.jsonl").write_text(rows)
    return tmp_path


def _write(job_dir: Path, text: str) -> Path:
    path = job_dir / "job.yaml"
    path.write_text(MODEL + textwrap.dedent(text))
    return path


def _problems(path: Path) -> dict[str, str]:
    with pytest.raises(JobError) as caught:
        load_job(path)
    return {p.path: p.render() for p in caught.value.problems}


def _warnings(job_dir: Path, text: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """validate's warning lines for a job that must validate (exit 0)."""
    assert validate_command(str(_write(job_dir, text))) == 0
    return [
        line.strip() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("warning:")
    ]


def test_an_eval_fraction_above_one_half_is_refused(job_dir: Path) -> None:
    """eval_fraction 0.999 (and anything above 0.5) is a problem naming the limit and eval_path."""
    found = _problems(_write(job_dir, "data: {path: ./rows40.jsonl, eval_fraction: 0.999}\n"))
    assert "more than 0.5" in found["data.eval_fraction"] and "eval_path" in found["data.eval_fraction"]


def test_an_eval_fraction_leaving_no_training_record_is_warned_about(
    job_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """0.5 of 1 record holds it out and trains on none: validate says the trainer will refuse it."""
    lines = _warnings(job_dir, "data: {path: ./rows1.jsonl, eval_fraction: 0.5}\n", capsys)
    assert any("holds out all 1: the trainer will refuse to start" in line for line in lines), lines


def test_a_tiny_training_split_is_warned_about(job_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """0.5 of 3 records trains on 1: validate says so with the counts and the effective batch."""
    text = "data: {path: ./rows3.jsonl, eval_fraction: 0.5}\ntrain: {effective_batch_size: 4, max_steps: 5}\n"
    lines = _warnings(job_dir, text, capsys)
    assert any("data.eval_fraction" in line and "trains on 1 and evaluates on 2" in line for line in lines), (
        lines
    )


def test_a_sensible_split_gets_no_warning(job_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """0.1 of 40 records with an effective batch of 4 says nothing."""
    text = (
        "data: {path: ./rows40.jsonl, eval_fraction: 0.1}\ntrain: {effective_batch_size: 4, max_steps: 5}\n"
    )
    assert _warnings(job_dir, text, capsys) == []


def test_max_steps_and_epochs_together_say_which_wins(
    job_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both set: validate warns that max_steps wins and epochs is ignored."""
    lines = _warnings(job_dir, "data: {path: ./rows40.jsonl}\ntrain: {max_steps: 50, epochs: 3}\n", capsys)
    assert any("train.epochs" in line and "max_steps wins" in line for line in lines), lines
    assert _warnings(job_dir, "data: {path: ./rows40.jsonl}\ntrain: {max_steps: 50}\n", capsys) == []


def test_a_gpu_index_on_a_machine_without_gpus_is_said_at_validate(job_dir: Path) -> None:
    """gpu: 0 where NVML sees no GPU, or cuda:2 where one is visible, is a warning naming the fix."""
    job = load_job(_write(job_dir, "data: {path: ./rows40.jsonl}\nresources: {gpu: 0}\n"))
    none = job_advice(job, 40, gpu_count=lambda: None)
    assert [a.field for a in none] == ["resources.gpu"] and "no NVIDIA GPU is visible" in none[0].what
    assert "gpu: cpu" in none[0].fix
    assert job_advice(job, 40, gpu_count=lambda: 1) == []
    two = load_job(_write(job_dir, "data: {path: ./rows40.jsonl}\nresources: {gpu: 'cuda:2'}\n"))
    assert "1 GPU(s) visible" in job_advice(two, 40, gpu_count=lambda: 1)[0].what
    cpu = load_job(_write(job_dir, "data: {path: ./rows40.jsonl}\nresources: {gpu: cpu}\n"))
    assert job_advice(cpu, 40, gpu_count=lambda: None) == []


def test_the_validate_cli_warns_about_gpu_0_on_this_gpu_less_machine(job_dir: Path) -> None:
    """On a machine where NVML finds no GPU (this test skips elsewhere), `validate` of gpu: 0 warns."""
    from qlora_supervise.supervisor.watching.gpu import visible_gpu_count

    if visible_gpu_count():
        pytest.skip("this machine has a GPU")
    path = _write(job_dir, "data: {path: ./rows40.jsonl}\nresources: {gpu: 0}\n")
    done = subprocess.run(
        [sys.executable, "-m", "qlora_supervise.supervisor.commands.cli", "validate", str(path)],
        capture_output=True,
        text=True,
        timeout=120,  # generous: one interpreter start and the job's checks, on a loaded machine
        check=False,
    )
    assert done.returncode == 0 and "warning: resources.gpu: cuda:0: no NVIDIA GPU is visible" in done.stdout


@pytest.mark.parametrize("value", ["20", "90", "1.5"])
def test_a_duration_without_a_unit_is_read_as_seconds_and_warned_about(
    job_dir: Path, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    """hang_timeout: 20 stays 20 seconds (old job files load) and validate names it with the fix."""
    lines = _warnings(
        job_dir, f"data: {{path: ./rows40.jsonl}}\nsupervise: {{hang_timeout: {value}}}\n", capsys
    )
    assert lines == [
        f"warning: supervise.hang_timeout: {value} has no unit and is read as {value} seconds; "
        f"write {value}s (or {value}m if you meant minutes)"
    ]
    assert load_job(job_dir / "job.yaml").supervise.hang_timeout == float(value)


def test_durations_with_units_get_no_warning(job_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """20m, 90s and 0 (the same in every unit) are said nothing about."""
    text = (
        "data: {path: ./rows40.jsonl}\nsupervise: {hang_timeout: 20m, stop_grace: 90s, contention_wait: 0}\n"
    )
    assert _warnings(job_dir, text, capsys) == []


@pytest.mark.parametrize(("text", "fix"), [("12Gb", "12GB"), ("12Gib", "12GiB"), ("500Mb", "500MB")])
def test_bits_are_refused_with_the_byte_spelling(text: str, fix: str) -> None:
    """A capital prefix with a small b is bits: refused, naming the byte form."""
    with pytest.raises(UnitError, match="bits") as caught:
        parse_bytes(text)
    assert f"{fix} for bytes" in str(caught.value)


def test_a_job_cap_in_gigabits_is_a_problem_with_the_fix(job_dir: Path) -> None:
    """resources.gpu_memory_limit: 12Gb is refused at load, and the problem says 12GB."""
    found = _problems(_write(job_dir, "data: {path: ./rows40.jsonl}\nresources: {gpu_memory_limit: 12Gb}\n"))
    assert "bits" in found["resources.gpu_memory_limit"] and "12GB" in found["resources.gpu_memory_limit"]


@pytest.mark.parametrize("text", ["24", "24B", "900KiB"])
def test_an_implausible_memory_size_is_refused_with_a_gib_suggestion(text: str) -> None:
    """A card size below 1 MiB (a bare 24 is 24 bytes) is refused, suggesting GiB."""
    with pytest.raises(UnitError, match="not a plausible memory size") as caught:
        parse_memory_size(text)
    assert "GiB" in str(caught.value)
    assert parse_memory_size("24GiB") == 24 * 1024**3


def test_plan_gpu_memory_24_is_refused(job_dir: Path) -> None:
    """`plan --gpu-memory 24` exits 2 (bad input) with the 24GiB suggestion, not a nonsense plan."""
    from qlora_supervise.supervisor.commands.plan import make_plan

    path = _write(job_dir, "data: {path: ./rows40.jsonl}\n")
    with pytest.raises(SupervisorExit) as caught:
        make_plan(str(path), "24")
    assert caught.value.code == 2 and "24GiB" in str(caught.value)


def test_run_says_the_advice_again_at_start(tmp_path: Path) -> None:
    """`run` of a job with `hang_timeout: 2` journals a job_advice warning naming the field and the fix."""
    import io

    sys.path.insert(0, str(Path(__file__).parent))
    from run_scripted import scripted_seams
    from test_loop import _events, _job

    from qlora_supervise.supervisor.commands.run import run_job

    job = _job(tmp_path, {"default": "ok"}, hang_timeout=2)
    console = io.StringIO()
    assert run_job(str(job), plain=True, seams=scripted_seams(), console=console, install_signals=False) == 0
    advice = _events(tmp_path, "job_advice")
    assert [(a["field"], a["fix"]) for a in advice] == [
        ("supervise.hang_timeout", "write 2s (or 2m if you meant minutes)")
    ]
    assert "job_advice" in console.getvalue() and "hang_timeout" in console.getvalue()
