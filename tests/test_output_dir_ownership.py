"""An output_dir is a run of ours or nothing (issue 29 item 1): the real ``qlora-supervise`` on a tmp job.

A folder that holds files but no run journal of ours, a home directory and the system's folders are
refused by ``validate`` and ``run`` (exit 2, naming the folder and the fix); ``run --restart`` in a
user's folder moves and overwrites nothing.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from _cli import cli

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import _job, _run

CLI = Path(sys.executable).with_name("qlora-supervise")


def _cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=timeout, check=False)


def _with_output_dir(job: Path, output_dir: str) -> Path:
    raw = yaml.safe_load(job.read_text())
    raw["output_dir"] = output_dir
    job.write_text(yaml.safe_dump(raw))
    return job


def _tree(root: Path) -> dict[str, str]:
    """Every path under ``root`` with a digest of its bytes (folders: ``dir``)."""
    return {
        str(p.relative_to(root)): "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
    }


def _users_folder(root: Path) -> Path:
    """A folder of a user's own training: an adapter, a state.json, a checkpoint and a job.yaml."""
    (root / "adapter").mkdir(parents=True)
    (root / "adapter" / "adapter_config.json").write_text('{"r": 64}\n')
    (root / "adapter" / "adapter_model.safetensors").write_bytes(b"user weights" * 100)
    (root / "checkpoints" / "checkpoint-5").mkdir(parents=True)
    (root / "checkpoints" / "checkpoint-5" / "trainer_state.json").write_text('{"global_step": 5}\n')
    (root / "state.json").write_text('{"mine": true}\n')
    (root / "job.yaml").write_text("my: own notes\n")
    return root


@pytest.mark.parametrize("restart", [False, True])
def test_a_users_folder_is_refused_by_validate_and_run_and_restart_moves_nothing(
    tmp_path: Path, restart: bool
) -> None:
    """A non-empty folder with no run of ours: validate and run (--restart or not) exit 2, files kept."""
    job = _with_output_dir(_job(tmp_path, {"default": "ok"}), "mine")
    before = _tree(_users_folder(tmp_path / "mine"))
    checked = _cli("validate", str(job))
    assert checked.returncode == 2, checked.stdout
    assert "output_dir" in checked.stdout and str(tmp_path / "mine") in checked.stdout
    assert "holds no run of qlora-supervise" in checked.stdout and "new or empty folder" in checked.stdout
    run = _cli("run", *(["--restart"] if restart else []), str(job))
    assert run.returncode == 2, run.stderr
    assert "holds no run of qlora-supervise" in run.stderr and "Traceback" not in run.stderr
    assert _tree(tmp_path / "mine") == before  # no generations/, no .lock, nothing moved or replaced


@pytest.mark.parametrize(
    "where", ["/", "/etc", "/usr", "/var", "/proc/qlora-run", "/sys/kernel/x", "/dev/shm/x", "~"]
)
def test_system_folders_and_the_home_directory_are_refused_in_words(tmp_path: Path, where: str) -> None:
    """/, the home directory and system folders (and folders under /proc or /sys) are exit 2, no traceback
    (``main()`` in-process: the test above runs the real command on a refused folder)."""
    job = _with_output_dir(_job(tmp_path, {"default": "ok"}), where)
    checked = cli("validate", str(job))
    assert checked.returncode == 2, checked.stdout
    assert "output_dir: is " in checked.stdout and "folder of your own" in checked.stdout
    run = cli("run", str(job))
    assert run.returncode == 2, run.stderr
    assert "output_dir: is " in run.stderr and "Traceback" not in run.stderr


def test_a_run_of_ours_and_a_run_of_an_earlier_version_are_run_again(tmp_path: Path) -> None:
    """A finished run is run again; a folder with only an earlier version's run files validates."""
    job = _job(tmp_path, {"default": "ok"})
    assert _run(job) == 0
    assert _run(job) == 0
    # An earlier version's run directory: state.json, attempts.jsonl, events.jsonl, no job.vN files.
    old = tmp_path / "old"
    old.mkdir()
    for name in ("state.json", "attempts.jsonl", "events.jsonl", "job.yaml"):
        (old / name).write_bytes((tmp_path / "run" / name).read_bytes())
    checked = _cli("validate", str(_with_output_dir(job, "old")))
    assert checked.returncode == 0, checked.stdout
