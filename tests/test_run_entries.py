"""Every run-directory entry is ours and opened without following links; merge holds the run's lock
(issue 29 items 2, 3 and 9): the real supervisor with the scripted child, and the CLI's ``main()``
(in-process where a test is about the refusal, the real command where it is about the process)."""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from _child import child_env
from _cli import cli

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.record.rundir import ENTRIES

sys.path.insert(0, str(Path(__file__).parent))
from run_scripted import scripted_seams
from test_loop import _job, _run

CLI = Path(sys.executable).with_name("qlora-supervise")
RUNNER = Path(__file__).with_name("run_scripted.py")
CHECK = Path(__file__).with_name("merge_check.py")
NAMED = [entry for entry in ENTRIES if not entry.pattern]


def _supervise(job: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(RUNNER), str(job)], capture_output=True, text=True, timeout=120, check=False
    )


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(CLI), *args], capture_output=True, text=True, timeout=120, check=False)


def _finished(tmp_path: Path) -> Path:
    """A run of the scripted child that finished (adapter/ written), and its run directory."""
    assert _run(_job(tmp_path, {"default": "ok"})) == 0
    return tmp_path / "run"


def _digest(path: Path) -> str:
    return (
        "dir:" + ",".join(sorted(os.listdir(path)))
        if path.is_dir()
        else hashlib.sha256(path.read_bytes()).hexdigest()
    )


def _plant(run: Path, name: str, is_dir: bool, tmp_path: Path) -> Path:
    """A link at ``run/name`` to a target outside the run (a folder or a file); the target."""
    target = tmp_path / f"target-{name.strip('.')}"
    if is_dir:
        target.mkdir()
    else:
        target.write_text("precious\n")
    entry = run / name
    if entry.is_dir() and not entry.is_symlink():
        os.rename(entry, tmp_path / f"moved-{name.strip('.')}")
    elif entry.exists() or entry.is_symlink():
        entry.unlink()
    entry.symlink_to(target)
    return target


_FAST = {"merge-command", "trainer-output", "state.json"}


@pytest.mark.parametrize(
    "entry",
    [pytest.param(e, id=e.name, marks=() if e.name in _FAST else pytest.mark.slow) for e in NAMED],
)
def test_a_link_planted_at_any_run_entry_is_refused_and_nothing_is_written_through_it(
    tmp_path: Path, entry: object
) -> None:
    """A link at each registered entry of a finished run: run and merge exit 2, the target keeps its bytes."""
    from qlora_supervise.supervisor.record.rundir import Entry

    assert isinstance(entry, Entry)
    run = _finished(tmp_path)
    target = _plant(run, entry.name, entry.is_dir, tmp_path)
    before = _digest(target)
    again = cli("run", str(tmp_path / "job.yaml"))
    assert again.returncode == 2, again.stderr
    assert "symbolic link" in again.stderr and entry.name in again.stderr and "Traceback" not in again.stderr
    if entry.name != "adapter":  # merge needs adapter/adapter_config.json first
        merged = cli("merge", str(run), "--device", "cpu")
        assert merged.returncode == 2, merged.stderr
        assert "symbolic link" in merged.stderr and "Traceback" not in merged.stderr
    assert _digest(target) == before


def test_a_run_writes_no_top_level_entry_that_is_not_registered(tmp_path: Path) -> None:
    """Every name a run (with a retry, a job change and a stop) leaves at the top is one of ENTRIES."""
    from fnmatch import fnmatch

    job = _job(tmp_path, {"1": "oom_forward@3"})
    assert _run(job) == 0
    job.write_text(job.read_text().replace("max_steps: 10", "max_steps: 12"))
    assert _run(job) == 0
    run = tmp_path / "run"
    unregistered = [p.name for p in run.iterdir() if not any(fnmatch(p.name, e.name) for e in ENTRIES)]
    assert unregistered == []
    assert (run / "attempt-002").is_dir()  # the extension ran: the listing covers more than one attempt


def test_merge_is_refused_while_a_supervisor_holds_the_lock_and_writes_nothing(tmp_path: Path) -> None:
    """merge on a run whose lock is held: exit 2 in words, no merge-command/ and no merged/ written."""
    run = _finished(tmp_path)
    with open(run / ".lock", "r+") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        done = cli("merge", str(run), "--device", "cpu")
    assert done.returncode == 2, done.stderr
    assert "a supervisor is running on" in done.stderr and "merge once it has ended" in done.stderr
    assert not (run / "merge-command").exists() and not (run / "merged").exists()


def test_merge_on_cuda_without_a_gpu_is_refused(tmp_path: Path) -> None:
    """merge --device cuda where no GPU is visible: exit 2 with the fix, nothing started or written."""
    run = _finished(tmp_path)
    done = subprocess.run(
        [str(CLI), "merge", str(run), "--device", "cuda"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "no GPU is visible" in done.stderr and "--device cpu" in done.stderr
    assert not (run / "merge-command").exists()


@pytest.mark.slow
def test_merge_records_the_adapter_step_and_status_says_when_it_is_older(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """A real merge of the tiny model: merge.json and status name the adapter's step, and a later
    training makes status say the merge is older than the adapter; merge-command/ is 0750 with 0640 files."""
    job = _job(tmp_path, {"default": "ok"})
    job.write_text(job.read_text().replace("path: model", f"path: {tiny_dir / 'model'}"))
    assert _supervise(job).returncode == 0
    run = tmp_path / "run"
    made = subprocess.run(
        [sys.executable, str(CHECK), "adapter", str(tiny_dir / "model"), str(tmp_path / "real-adapter")],
        env=child_env(),
        capture_output=True,
        text=True,
        check=False,
    )
    assert made.returncode == 0, made.stderr[-2000:]
    for name in os.listdir(tmp_path / "real-adapter"):  # the scripted child's adapter is only a stand-in
        (run / "adapter" / name).write_bytes((tmp_path / "real-adapter" / name).read_bytes())
    done = _cli("merge", str(run), "--device", "cpu")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(the adapter of step 10)" in done.stdout
    assert json.loads((run / "merged" / "merge.json").read_text())["adapter_step"] == 10
    status = _cli("status", str(run))
    assert "from the adapter of step 10" in status.stdout and "older" not in status.stdout
    work = run / "merge-command"
    assert stat.S_IMODE(work.stat().st_mode) == 0o750
    assert all(stat.S_IMODE(p.stat().st_mode) & ~0o640 == 0 for p in work.iterdir())
    job.write_text(job.read_text().replace("max_steps: 10", "max_steps: 12"))  # the run is extended
    assert _supervise(job).returncode == 0
    (run / "merged-before-extend-1").rename(run / "merged")  # as if the old merge were still in place
    status = _cli("status", str(run))
    assert "from the adapter of step 10: older than the run's adapter (step 12)" in status.stdout


@pytest.mark.slow  # the merge child imports torch, transformers and peft: about 11 s of CPU
def test_merge_command_folder_is_0750_and_its_files_0640_whatever_the_umask(tmp_path: Path) -> None:
    """Under umask 000, a merge (failing on the stand-in model) leaves merge-command/ 0750, files 0640."""
    run = _finished(tmp_path)
    done = subprocess.run(
        ["/bin/sh", "-c", f"umask 000 && exec {CLI} merge {run} --device cpu"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 4, done.stderr[-2000:]  # the stand-in model cannot be merged
    work = run / "merge-command"
    assert stat.S_IMODE(work.stat().st_mode) == 0o750
    files = {p.name: stat.S_IMODE(p.stat().st_mode) for p in work.iterdir()}
    assert {"spec.json", "child.log"} <= files.keys()
    assert all(mode & ~0o640 == 0 for mode in files.values()), files


def test_a_tool_value_that_did_not_parse_is_recorded_as_written_not_as_its_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """trl's max_steps: ten is recorded as 'ten'; fixing it to 2 after a failed run mixes no trainings."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    sft = (
        "model_name_or_path: model\ndataset_name: /data/set\nuse_peft: true\nmax_steps: ten\nsave_steps: 10\n"
    )
    (tmp_path / "sft.yaml").write_text(sft)
    job = tmp_path / "job.yaml"
    job.write_text(
        "trainer: {kind: trl-sft, config: sft.yaml}\nresources: {gpu: cpu}\n"
        "supervise: {hang_timeout: 5s, backoff_initial: 0.05s, backoff_max: 0.2s}\noutput_dir: run\n"
    )
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"default": "config_error"}))  # the tool refuses its config: nothing trained
    monkeypatch.setenv("SCRIPTED_CHILD_PLAN", str(plan))
    assert _run(job) == 4
    view = json.loads((tmp_path / "run" / "job.v1.json").read_text())
    assert view["train.max_steps"] == "ten" and view["train.save_steps"] == 10
    (tmp_path / "sft.yaml").write_text(sft.replace("max_steps: ten", "max_steps: 2"))
    console, summary = io.StringIO(), io.StringIO()
    run_job(
        str(job), plain=True, seams=scripted_seams(), console=console, install_signals=False, summary=summary
    )
    said = console.getvalue() + summary.getvalue()
    assert "train.max_steps: 'ten' -> 2  (applies on resume)" in said
    assert "-1 -> 2" not in said and "would mix two trainings" not in said and "epochs" not in said
