"""Reporting: the metrics textfile, the on_event hook, journald priorities, readable progress."""

from __future__ import annotations

import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from qlora_supervise.supervisor.record.eventlog import ConsoleLines, open_event_log, read_events
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.reporting.console import Pace, PaceMeter, ProgressDisplay, plain_line
from qlora_supervise.supervisor.reporting.notify import status_line
from qlora_supervise.supervisor.reporting.outputs import EventHook, MetricsTextfile
from qlora_supervise.supervisor.watching.watch import Progress


def _scrape(path: Path) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """What Prometheus would read from node_exporter's textfile collector."""
    samples = {}
    for family in text_string_to_metric_families(path.read_text()):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_metrics_textfile_scrapes_attempts_step_peak_budget_and_state(tmp_path: Path) -> None:
    """Events and progress become Prometheus samples in a .prom file that parses as exposition format."""
    path = tmp_path / "textfile" / "job.prom"
    metrics = MetricsTextfile(path, "myjob", budget_bytes=8 * 2**30)
    metrics.on_event({"event": "attempt_started", "attempt": 1})
    metrics.on_event({"event": "failure_classified", "kind": "oom_forward"})
    metrics.on_event({"event": "retry"})
    progress = Progress(step=42, stage="forward", max_steps=100, tokens_per_s=1900.0, peak_bytes=5 * 2**30)
    metrics.progress(2, progress, now=1000.0)
    metrics.on_event({"event": "backoff"})
    scraped = _scrape(path)
    run = (("run", "myjob"),)
    assert (
        scraped[("qlora_supervise_attempts_total", (("kind", "oom_forward"), ("outcome", "failed"), *run))]
        == 1
    )
    assert scraped[("qlora_supervise_step", run)] == 42
    assert scraped[("qlora_supervise_max_steps", run)] == 100
    assert scraped[("qlora_supervise_tokens_per_second", run)] == 1900
    assert scraped[("qlora_supervise_peak_bytes", run)] == 5 * 2**30
    assert scraped[("qlora_supervise_budget_bytes", run)] == 8 * 2**30
    assert scraped[("qlora_supervise_state", (("qlora_supervise_state", "backoff"), *run))] == 1
    assert scraped[("qlora_supervise_state", (("qlora_supervise_state", "running"), *run))] == 0
    assert [p.name for p in path.parent.iterdir()] == ["job.prom"]  # the temp file was renamed away


def test_metrics_textfile_refuses_a_name_node_exporter_would_skip(tmp_path: Path) -> None:
    """node_exporter reads only *.prom: another suffix is refused with the reason."""
    with pytest.raises(ValueError, match=r"\*\.prom"):
        MetricsTextfile(tmp_path / "job.txt", "job", None)


def _hook_script(tmp_path: Path, body: str) -> list[str]:
    script = tmp_path / "hook.py"
    script.write_text(f"import json, os, sys, time\n{body}\n")
    return [sys.executable, str(script)]


def test_on_event_hook_gets_the_event_json_on_stdin_for_the_hooked_events(tmp_path: Path) -> None:
    """retry, gave_up and run_succeeded run the argv with the event's JSON on stdin; others do not."""
    seen = tmp_path / "seen.jsonl"
    record = f"open({str(seen)!r}, 'a').write(json.dumps([os.environ['QLORA_SUPERVISE_EVENT'], e]) + '\\n')"
    argv = _hook_script(tmp_path, f"e = json.load(sys.stdin)\n{record}")
    hook = EventHook(argv, timeout_s=20)
    log = open_event_log(tmp_path / "events.jsonl", None, [hook.on_event])
    hook.log = log
    log.info(Event.ATTEMPT_STARTED, attempt=1)
    log.warning(Event.RETRY, attempt=1, rung="gradient_checkpointing")
    log.error(Event.GAVE_UP, why="ladder exhausted")
    got = [json.loads(line) for line in seen.read_text().splitlines()]
    assert [name for name, _ in got] == ["retry", "gave_up"]
    assert got[0][1]["rung"] == "gradient_checkpointing" and got[0][1]["level"] == "warning"
    assert got[1][1]["level"] == "error"


@pytest.mark.parametrize(
    ("body", "problem"),
    [("sys.exit(3)", "exit status 3"), ("time.sleep(5)", "timed out"), (None, "could not start")],
)
def test_a_failing_hook_is_logged_and_the_log_goes_on(tmp_path: Path, body: str | None, problem: str) -> None:
    """A hook that fails, hangs past its timeout or does not exist gives hook_failed and nothing else."""
    argv = _hook_script(tmp_path, body) if body else [str(tmp_path / "no-such-hook")]
    hook = EventHook(argv, timeout_s=0.5)
    log = open_event_log(tmp_path / "events.jsonl", None, [hook.on_event])
    hook.log = log
    log.info(Event.RUN_SUCCEEDED, attempts=1)
    log.info(Event.STOPPED)
    names = [e["event"] for e in read_events(tmp_path / "events.jsonl")]
    assert names == ["run_succeeded", "hook_failed", "stopped"]
    failed = read_events(tmp_path / "events.jsonl")[1]
    assert (
        problem in failed["problem"]
        and failed["level"] == "warning"
        and failed["for_event"] == "run_succeeded"
    )


def test_console_lines_carry_journald_priorities_under_journald(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under journald a retry is <4> (warning), a gave_up <3> (error), an attempt start <6> (info)."""
    stream_path = tmp_path / "stderr"
    with stream_path.open("w") as stream:
        info = os.fstat(stream.fileno())
        monkeypatch.setenv("JOURNAL_STREAM", f"{info.st_dev}:{info.st_ino}")
        log = open_event_log(tmp_path / "events.jsonl", stream)
        log.info(Event.ATTEMPT_STARTED, attempt=1)
        log.warning(Event.RETRY, attempt=1)
        log.error(Event.GAVE_UP, why="x")
    lines = stream_path.read_text().splitlines()
    assert [line[:3] for line in lines] == ["<6>", "<4>", "<3>"]
    assert "retry" in lines[1] and "gave_up" in lines[2]


def test_console_lines_show_local_time_not_epoch_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off journald the console line starts with a local date and time, and no epoch number appears."""
    monkeypatch.delenv("JOURNAL_STREAM", raising=False)
    event: dict[str, Any] = {"event": "retry", "level": "warning", "time": 1795944559.076, "attempt": 1}
    line = ConsoleLines(io.StringIO()).render(None, "warning", event)
    assert "1795944559" not in line
    assert line[:4].isdigit() and line[4] == "-" and line[13] == ":"


def test_plain_progress_prints_one_line_per_logging_step_with_elapsed_and_eta() -> None:
    """--plain: a line at every logging_steps-th step (and on a stage change), with human times."""
    out = io.StringIO()
    display = ProgressDisplay(out, plain=True, logging_steps=5)
    meter = PaceMeter()
    for second, step in enumerate(range(0, 21)):
        p = Progress(step=step, stage="forward", max_steps=20, peak_bytes=2**30)
        display.update(1, p, meter.measure(1, p, float(second * 30)))
    lines = out.getvalue().splitlines()
    assert [line.split(" | ")[1] for line in lines] == [f"step {s}/20" for s in (0, 5, 10, 15, 20)]
    assert "05:00 elapsed, ETA 05:00" in lines[2]  # 30 s per step: step 10 at 300 s, 10 steps left
    assert "peak 1.00 GiB" in lines[1]


def test_status_line_reads_like_the_issue_asks() -> None:
    """attempt 3/8 · step 420/1000 · 1.9k tok/s · peak 21.3/24 GiB · ETA 2:10:00 (tqdm's format)."""
    p = Progress(
        step=420, stage="backward", max_steps=1000, tokens_per_s=1912.0, peak_bytes=int(21.3 * 2**30)
    )
    line = status_line(3, 8, p, Pace(100.0, 7800.0), 24 * 2**30)
    assert line == "attempt 3/8 · step 420/1000 · 1.9k tok/s · peak 21.3/24 GiB · ETA 2:10:00"


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "00:00"), (42.4, "00:42"), (725, "12:05"), (7800, "2:10:00"), (273600, "76:00:00")],
)
def test_durations_print_as_tqdms_bar_prints_them(seconds: float, text: str) -> None:
    """The plain line and systemd's status print durations as the tqdm bar does (whole seconds, no epoch)."""
    assert tqdm.format_interval(seconds) == text
    p = Progress(step=1, stage="forward", max_steps=2)
    assert plain_line(1, p, Pace(seconds, seconds)).endswith(f"{text} elapsed, ETA {text}")
    assert status_line(1, 8, p, Pace(seconds, seconds), None).endswith(f"ETA {text}")
