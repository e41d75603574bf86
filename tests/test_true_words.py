"""Refuse, warn or say the true thing (issue 29 item 11: the issue's points 12-14), through
``qlora-supervise`` on a tmp job: explain, plan, install-systemd, and the datasets cache of a real run.
The commands run by ``main()`` in-process where a test is about their words (a process pays the
supervisor's import each time); the plan's host warning and the real run start the real command."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _child import capped_job, child_env
from _cli import cli

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import _job, _run

CLI = Path(sys.executable).with_name("qlora-supervise")
#: A 7B Llama's config: the memory model reads it (no weights needed for a plan).
LLAMA_7B = {
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "torch_dtype": "float16",
}


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(CLI), *args], capture_output=True, text=True, timeout=300, env=env, check=False
    )


def _edit(job: Path, **sections: dict[str, object]) -> Path:
    raw = yaml.safe_load(job.read_text())
    for name, values in sections.items():
        raw.setdefault(name, {}).update(values)
    job.write_text(yaml.safe_dump(raw))
    return job


def _finished(tmp_path: Path, gpu: str = "cpu") -> Path:
    assert _run(_edit(_job(tmp_path, {"default": "ok"}), resources={"gpu": gpu})) == 0
    return tmp_path / "run"


def test_explain_plot_into_a_missing_folder_is_refused_in_words(tmp_path: Path) -> None:
    """explain --plot no/such/dir/x.png: exit 2 naming the folder, no traceback, nothing written."""
    run = _finished(tmp_path)
    done = cli("explain", str(run), "--plot", str(tmp_path / "no" / "such" / "x.png"))
    assert done.returncode == 2, done.stderr
    assert f"{tmp_path / 'no' / 'such'} does not exist" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize(("device", "predicted"), [("cpu", False), ("cuda", True)])
def test_explain_predicts_a_gpu_peak_only_for_an_attempt_that_ran_on_a_gpu(
    tmp_path: Path, device: str, predicted: bool
) -> None:
    """gpu: auto, and the child said it started on the CPU: no GPU prediction beside the CPU measurement."""
    run = _finished(tmp_path, gpu="auto")
    events = run / "attempt-001" / "child-events.jsonl"
    events.write_text(json.dumps({"event": "started", "device": device}) + "\n" + events.read_text())
    (tmp_path / "llama.json").write_text(json.dumps(LLAMA_7B))
    done = cli("explain", str(run), "--json", "--model-config", str(tmp_path / "llama.json"))
    assert done.returncode == 0, done.stderr
    row = json.loads(done.stdout)["attempts"][0]
    assert (row["predicted_peak_bytes"] is not None) is predicted


def _plan_job(tmp_path: Path, **resources: object) -> Path:
    job = _edit(_job(tmp_path, {"default": "ok"}), resources=resources)
    (tmp_path / "model" / "config.json").write_text(json.dumps(LLAMA_7B))
    return job


def test_plan_exits_6_on_nothing_fits_as_run_does(tmp_path: Path) -> None:
    """plan of a 7B model on a 2 GiB card prints NOTHING FITS and exits 6, the code run ends with."""
    job = _plan_job(tmp_path, gpu="cpu")
    done = cli("plan", str(job), "--gpu-memory", "2GiB")
    assert done.returncode == 6, done.stdout + done.stderr
    assert "NOTHING FITS" in done.stdout
    assert cli("plan", str(job), "--gpu-memory", "80GiB").returncode == 0


def test_plan_names_what_its_host_warning_compares_with_and_counts_the_cpu_imports(tmp_path: Path) -> None:
    """A CPU job capped at 4 GiB: the warning names cpu_memory_limit, the basis the CPU build's imports."""
    job = _plan_job(tmp_path, gpu="cpu", cpu_memory_limit="4GiB")
    done = _cli("plan", str(job), "--gpu-memory", "80GiB")
    assert done.returncode == 0, done.stderr
    assert "more host RAM than the cpu_memory_limit (4.00 GiB)" in done.stdout
    assert "imports 0.5 GB (the CPU build's)" in done.stdout and "imports 1.6 GB" not in done.stdout
    host = json.loads(cli("plan", str(job), "--gpu-memory", "80GiB", "--json").stdout)["host"]
    assert host["room_of"] == "cpu_memory_limit" and host["room_bytes"] == 4 * 2**30


def test_plan_of_an_hf_script_without_a_model_names_the_tools_flag(tmp_path: Path) -> None:
    """An hf-script job without --model_name_or_path: plan exits 2 naming that flag, not model.path."""
    (tmp_path / "train.py").write_text("")
    job = tmp_path / "job.yaml"
    command = ["python", "train.py", "--output_dir", "out"]
    job.write_text(
        yaml.safe_dump({"trainer": {"kind": "hf-script", "command": command}, "output_dir": "run"})
    )
    done = cli("plan", str(job))
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--model_name_or_path DIR" in done.stderr and "model.path" not in done.stderr


def test_install_systemd_says_to_create_the_user_and_warns_of_tmp_under_private_tmp(tmp_path: Path) -> None:
    """A system unit for a missing user and a job under /tmp: both said, with the fix; the unit is written."""
    job = _job(tmp_path, {"default": "ok"})
    root = tmp_path / "root"
    done = cli(
        "install-systemd", str(job), "--system", "--root", str(root), "--service-user", "no-such-user-29"
    )
    assert done.returncode == 0, done.stderr
    assert "User=no-such-user-29, and there is no such user here" in done.stdout
    assert "sudo useradd --system --create-home no-such-user-29" in done.stdout
    if str(tmp_path).startswith("/tmp/"):
        assert "output_dir is under /tmp" in done.stdout and "PrivateTmp=yes" in done.stdout
    assert (root / "etc" / "systemd" / "system" / "qlora-supervise@.service").is_file()


@pytest.mark.slow
def test_the_childs_datasets_cache_is_in_the_run_directory(tiny_dir: Path, tmp_path: Path) -> None:
    """A real run (tiny model, HOME elsewhere, no HF_HOME): datasets' cache is in run/, not ~/.cache."""
    job = capped_job(tiny_dir, tmp_path, max_steps=1, save_steps=1)
    raw = yaml.safe_load(job.read_text())
    raw["train"].update(micro_batch_size=1, max_seq_len=64)
    raw["resources"] = {"gpu": "cpu"}
    job.write_text(yaml.safe_dump(raw))
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in child_env(HOME=str(home)).items() if k not in ("HF_HOME", "HF_DATASETS_CACHE")}
    done = _cli("run", "--plain", str(job), env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    cache = tmp_path / "run" / "datasets-cache"
    assert cache.is_dir() and any(cache.rglob("*.arrow")), sorted(map(str, cache.rglob("*")))[:20]
    assert not (home / ".cache" / "huggingface" / "datasets").exists()


def test_explain_plot_and_merge_out_into_proc_are_refused_in_words(tmp_path: Path) -> None:
    """explain --plot /proc/x.png and merge --out /proc/x: exit 2 in words, no traceback, no merge started."""
    run = _finished(tmp_path)
    plot = cli("explain", str(run), "--plot", "/proc/qlora-plot.png")
    assert plot.returncode == 2 and "cannot write it" in plot.stderr and "Traceback" not in plot.stderr
    merge = cli("merge", str(run), "--out", "/proc/qlora-merged", "--device", "cpu")
    assert merge.returncode == 2 and "is in the system folder /proc" in merge.stderr
    assert not (run / "merge-command").exists()
