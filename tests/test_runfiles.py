"""The run directory touches nothing outside itself: no writes through links, explicit modes, owner checks.

Issue 11 items 12 and 13, with the real supervisor and the scripted child (real processes). A run
refused before its first attempt is ``run``'s ``main()`` in-process (the words and the exit status are
the point; test_output_dir_ownership refuses with the real command); the modes need a process's umask.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from _cli import cli

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import _job, _run

RUNNER = Path(__file__).with_name("run_scripted.py")


def _supervise(job: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RUNNER), str(job)], capture_output=True, text=True, timeout=120, check=False
    )


# One planted name of each kind runs in the fast tier; the others (a supervisor process each) are slow.
_SLOW = pytest.mark.slow
_RUN_FILES = ("events.jsonl", "attempts.jsonl", "state.json")
_CHECKPOINT_LINKS = ("checkpoints/checkpoint-4", "checkpoints-quarantine")


@pytest.mark.parametrize(
    "name",
    [".lock", *(pytest.param(n, marks=_SLOW) for n in _RUN_FILES)],
)
def test_a_planted_link_in_the_run_directory_is_refused_and_its_target_untouched(
    tmp_path: Path, name: str
) -> None:
    """Issue 11 item 12: a run file that is a symlink stops the run (exit 2); its target keeps its bytes."""
    job = _job(tmp_path, {"default": "ok"})
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    (tmp_path / "run").mkdir(mode=0o750)
    (tmp_path / "run" / name).symlink_to(victim)
    done = cli("run", str(job))
    assert done.returncode == 2, done.stderr
    assert "symbolic link" in done.stderr and name in done.stderr
    assert "Traceback" not in done.stderr
    assert victim.read_text() == "precious\n"


@pytest.mark.parametrize(
    "planted",
    [
        "checkpoints",
        *(pytest.param(n, marks=_SLOW) for n in _CHECKPOINT_LINKS),
    ],
)
def test_a_planted_checkpoints_link_is_refused_and_its_target_untouched(tmp_path: Path, planted: str) -> None:
    """Issue 21 item 3: checkpoints/, a checkpoint-N in it, or the quarantine as a link stops the run (2)."""
    job = _job(tmp_path, {"default": "ok"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("precious\n")
    (tmp_path / "run" / "checkpoints").mkdir(mode=0o750, parents=True)
    os.chmod(tmp_path / "run", 0o750)
    link = tmp_path / "run" / planted
    if link.is_dir():
        link.rmdir()
    link.symlink_to(elsewhere)
    done = cli("run", str(job))
    assert done.returncode == 2, done.stderr
    assert "symbolic link" in done.stderr and planted.split("/")[-1] in done.stderr
    assert "Traceback" not in done.stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"]
    assert not (tmp_path / "run" / "attempts.jsonl").exists()


def test_an_attempt_directory_planted_as_a_link_is_never_written_through(tmp_path: Path) -> None:
    """Issue 11 item 12: a link named attempt-001 is renamed aside, never followed."""
    job = _job(tmp_path, {"default": "ok"})
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "run").mkdir(mode=0o750)
    # A run of ours that stopped after its first event (a folder of only a link is no run of ours).
    (tmp_path / "run" / "events.jsonl").write_text('{"event": "run_started", "level": "info"}\n')
    (tmp_path / "run" / "attempt-001").symlink_to(elsewhere)
    assert _run(job) == 0
    assert list(elsewhere.iterdir()) == []
    assert (tmp_path / "run" / "attempt-001").is_dir() and not (tmp_path / "run" / "attempt-001").is_symlink()


def test_an_output_dir_writable_by_others_is_refused(tmp_path: Path) -> None:
    """Issue 11 item 12: a world-writable output_dir is refused with the chmod that fixes it."""
    job = _job(tmp_path, {"default": "ok"})
    run = tmp_path / "run"
    run.mkdir()
    os.chmod(run, 0o777)
    done = cli("run", str(job))
    assert done.returncode == 2
    assert "writable by others" in done.stderr and "chmod o-w" in done.stderr
    assert not (run / "attempts.jsonl").exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="chown to another user needs root")
def test_an_output_dir_owned_by_another_user_is_refused(tmp_path: Path) -> None:
    """Issue 11 item 12: an output_dir owned by another uid is refused (the unit runs as root)."""
    job = _job(tmp_path, {"default": "ok"})
    run = tmp_path / "run"
    run.mkdir(mode=0o750)
    os.chown(run, 65534, 65534)
    done = cli("run", str(job))
    assert done.returncode == 2
    assert "owned by uid 65534" in done.stderr


def test_run_directory_modes_are_0750_and_0640_whatever_the_umask(tmp_path: Path) -> None:
    """Issue 11 item 13: under umask 000, directories are 0750 and files 0640 or stricter."""
    job = _job(tmp_path, {"1": "oom_forward@3"})
    old = os.umask(0)
    try:
        done = _supervise(job)
    finally:
        os.umask(old)
    assert done.returncode == 0, done.stderr
    root = tmp_path / "run"
    loose = []
    for path in [root, *root.rglob("*")]:
        mode = stat.S_IMODE(os.lstat(path).st_mode)
        allowed = 0o750 if path.is_dir() else 0o640
        if mode & ~allowed:
            loose.append(f"{path.relative_to(tmp_path)} {mode:04o}")
    assert stat.S_IMODE(os.stat(root).st_mode) == 0o750
    assert loose == []
