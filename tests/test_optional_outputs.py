"""Optional outputs are best-effort (issue 21, items 1 and 2): the metrics textfile, the hook, sd_notify.

A failure is logged once per output and then rate-limited, never raised into a log call or a
tick of the loop (where an OSError reads as the run disk being full), and a textfile that
cannot be created is refused by ``validate``. The last test is a real run with the scripted
child whose textfile's file system turns read-only mid-run.
"""

from __future__ import annotations

import errno
import io
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from _cli import cli

from qlora_supervise.supervisor.jobfile.load import load_job
from qlora_supervise.supervisor.jobfile.problems import JobError
from qlora_supervise.supervisor.record.eventlog import open_event_log, read_events
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.supervisor.reporting.console import ProgressDisplay
from qlora_supervise.supervisor.reporting.outputs import (
    METRICS_TEXTFILE,
    RELOG_EVERY_S,
    BestEffort,
    MetricsTextfile,
    Reporter,
)
from qlora_supervise.supervisor.watching.watch import Progress

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import _job, _wait_for

RUNNER = Path(__file__).with_name("run_scripted.py")


class Clock:
    """A clock the test moves by hand."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _read_only() -> None:
    raise OSError(errno.EROFS, "Read-only file system", "/metrics/job.prom")


def _names(path: Path) -> list[str]:
    return [e["event"] for e in read_events(path)]


def test_a_failing_output_is_logged_once_then_at_most_every_window_and_its_recovery_once(
    tmp_path: Path,
) -> None:
    """Repeated failures: one output_failed per window (with the unlogged count), then output_recovered."""
    clock = Clock()
    outputs = BestEffort(clock)
    outputs.log = open_event_log(tmp_path / "events.jsonl", None)
    for _ in range(5):
        assert outputs.run(METRICS_TEXTFILE, _read_only) is False
        clock.now += 1.0
    clock.now += RELOG_EVERY_S
    outputs.run(METRICS_TEXTFILE, _read_only)
    outputs.run(METRICS_TEXTFILE, lambda: False)  # nothing was due: neither a failure nor a recovery
    outputs.run(METRICS_TEXTFILE, lambda: None)
    outputs.run(METRICS_TEXTFILE, lambda: None)
    events = read_events(tmp_path / "events.jsonl")
    assert [e["event"] for e in events] == ["output_failed", "output_failed", "output_recovered"]
    first, again, recovered = events
    assert first["output"] == "supervise.metrics_textfile" and first["level"] == "warning"
    assert "Read-only file system" in first["problem"] and "metrics_textfile" in first["fix"]
    assert "unlogged_failures" not in first and again["unlogged_failures"] == 4
    assert recovered["failures"] == 6


def test_a_listener_that_raises_never_reaches_the_log_call(tmp_path: Path) -> None:
    """An EROFS from the textfile listener is logged as output_failed; the loop's log call returns."""
    outputs = BestEffort()
    log = open_event_log(
        tmp_path / "events.jsonl", None, [outputs.listener(METRICS_TEXTFILE, lambda e: _read_only())]
    )
    outputs.log = log
    log.info("attempt_started", attempt=1)  # would raise OSError(EROFS) into the loop unguarded
    log.warning("retry", attempt=1)
    assert _names(tmp_path / "events.jsonl") == ["attempt_started", "output_failed", "retry"]


def test_a_listeners_own_line_follows_the_line_it_reacts_to_on_the_console_too(tmp_path: Path) -> None:
    """The console keeps the file's order: the event first, then the output_failed its listener caused."""
    console = io.StringIO()
    outputs = BestEffort()
    log = open_event_log(
        tmp_path / "events.jsonl", console, [outputs.listener(METRICS_TEXTFILE, lambda e: _read_only())]
    )
    outputs.log = log
    log.warning("retry", attempt=1)
    log.info("attempt_started", attempt=2)  # within the window: no second output_failed
    lines = console.getvalue().splitlines()
    assert [
        next(w for w in ("retry", "output_failed", "attempt_started") if w in line) for line in lines
    ] == [
        "retry",
        "output_failed",
        "attempt_started",
    ]
    assert _names(tmp_path / "events.jsonl") == ["retry", "output_failed", "attempt_started"]


def test_the_reporters_tick_survives_a_textfile_whose_directory_went_away(tmp_path: Path) -> None:
    """A textfile that cannot be written mid-run costs the metrics, not the tick; writing again recovers."""
    directory = tmp_path / "textfile"
    metrics = MetricsTextfile(directory / "job.prom", "job", None)
    clock = Clock()
    reporter = Reporter(
        ProgressDisplay(io.StringIO(), plain=True), metrics=metrics, outputs=BestEffort(clock)
    )
    reporter.bind(open_event_log(tmp_path / "events.jsonl", None))
    assert (directory / "job.prom").is_file()
    (directory / "job.prom").unlink()
    directory.rmdir()
    directory.write_text("not a directory any more\n")  # ENOTDIR on the next write
    for step in range(1, 40):
        reporter.update(1, Progress(step=step, stage="forward", max_steps=100), now=clock.now)
        clock.now += 1.0
    directory.unlink()
    reporter.update(1, Progress(step=41, stage="forward", max_steps=100), now=clock.now + 60)
    assert _names(tmp_path / "events.jsonl") == ["output_failed", "output_recovered"]
    assert "step" in (directory / "job.prom").read_text()


@pytest.fixture
def job_dir(tmp_path: Path) -> Path:
    """A fake model directory and a one-record data file."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    return tmp_path


def _job_with_textfile(job_dir: Path, textfile: str) -> Path:
    path = job_dir / "job.yaml"
    raw = {
        "model": {"path": "./model"},
        "data": {"path": "./data.jsonl"},
        "supervise": {"metrics_textfile": textfile},
    }
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.parametrize(
    ("textfile", "problem", "fix"),
    [
        ("./blocker/job.prom", "blocker is not a directory", "choose a path under a directory"),
        ("./blocker/deeper/job.prom", "blocker is not a directory", "choose a path under a directory"),
        ("./metrics/job.txt", "reads only *.prom files", "name it job.prom"),
        ("./metrics", "is a directory", "name a file in it"),
    ],
)
def test_validate_refuses_a_textfile_that_cannot_be_created(
    job_dir: Path, textfile: str, problem: str, fix: str
) -> None:
    """validate names supervise.metrics_textfile, why it cannot be written, and the fix."""
    (job_dir / "blocker").write_text("a file where a directory should be\n")
    (job_dir / "metrics").mkdir()
    with pytest.raises(JobError) as caught:
        load_job(_job_with_textfile(job_dir, textfile))
    [found] = [p for p in caught.value.problems if p.path == "supervise.metrics_textfile"]
    assert problem in found.problem and fix in found.fix, found.render()


def test_validate_tries_the_textfile_directory_rather_than_asking_os_access(job_dir: Path) -> None:
    """A directory that takes no file (/proc: os.access says yes there to root) is refused, named,
    with the error creating a file gave; the probe leaves nothing behind in a directory that does."""
    with pytest.raises(JobError) as caught:
        load_job(_job_with_textfile(job_dir, "/proc/qlora-supervise-test.prom"))
    [found] = [p for p in caught.value.problems if p.path == "supervise.metrics_textfile"]
    assert "cannot be created: /proc does not take a file" in found.problem, found.render()
    (job_dir / "metrics").mkdir()
    load_job(_job_with_textfile(job_dir, "./metrics/job.prom"))
    assert list((job_dir / "metrics").iterdir()) == []


def test_validate_accepts_a_textfile_whose_directory_is_made_at_run_start(job_dir: Path) -> None:
    """A missing directory under a writable one is fine: the run creates it."""
    job = load_job(_job_with_textfile(job_dir, "./new/dir/job.prom"))
    assert job.supervise.metrics_textfile == job_dir / "new" / "dir" / "job.prom"


def test_run_with_a_textfile_that_cannot_be_created_exits_2_in_words(job_dir: Path) -> None:
    """`run` refuses the job before anything starts (exit 2, the field named), never with a traceback
    (``main()`` in-process: the refusal's words are the point)."""
    (job_dir / "blocker").write_text("x\n")
    job = _job_with_textfile(job_dir, "./blocker/job.prom")
    done = cli("run", "--plain", str(job))
    assert done.returncode == 2, done.stderr
    assert "supervise.metrics_textfile" in done.stderr + done.stdout and "Traceback" not in done.stderr


@pytest.fixture
def textfile_disk(tmp_path: Path) -> Iterator[Path]:
    """A 4 MiB tmpfs for the textfile (root only), unmounted after the test."""
    mount = tmp_path / "textfile-disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _child_step(run: Path) -> int:
    events = run / "attempt-001" / "child-events.jsonl"
    steps = [e.get("step", 0) for e in read_events(events)] if events.is_file() else []
    return max(steps, default=0)


def test_a_textfile_turned_read_only_mid_run_costs_the_metrics_not_the_training(
    tmp_path: Path, textfile_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Real run, scripted child: the textfile's mount turns read-only at step 2; training goes on, exit 0."""
    monkeypatch.setenv("SCRIPTED_CHILD_PLAN", "")  # _job sets it; monkeypatch puts the old value back
    textfile = textfile_disk / "job.prom"
    job = _job(tmp_path, {"1": "oom_forward@6", "default": "ok"}, metrics_textfile=str(textfile))
    env = {**os.environ, "SCRIPTED_CHILD_STEP_S": "0.2"}
    proc = subprocess.Popen(
        [sys.executable, str(RUNNER), str(job)], stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        _wait_for(lambda: textfile.is_file() and _child_step(tmp_path / "run") >= 2, timeout=60)
        remount = subprocess.run(["mount", "-o", "remount,ro", str(textfile_disk)], capture_output=True)
        assert remount.returncode == 0, remount.stderr
        started = time.monotonic()
        _, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert time.monotonic() - started < 60  # no stop grace, no disk wait
    events = read_events(tmp_path / "run" / "events.jsonl")
    names = [e["event"] for e in events]
    failed = [e for e in events if e["event"] == "output_failed"]
    assert len(failed) == 1 and failed[0]["output"] == "supervise.metrics_textfile", failed
    assert "Read-only file system" in failed[0]["problem"]
    assert not {"supervisor_disk_full", "waiting_for_disk", "orphan_child_stopping"} & set(names)
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert [r.outcome for r in records] == ["failed", "succeeded"]
    assert records[-1].steps_completed == 10
