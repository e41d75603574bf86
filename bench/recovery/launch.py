"""One process of an approach, run to its end or to its time limit, and what it cost itself.

:func:`launch` samples the process it started (never its children: the supervisor's trainer and
spare are other processes) every half second with psutil: its own CPU time (user + system) and
its peak RSS (``VmHWM`` from ``/proc``, which the kernel keeps, so a peak between two samples is
not missed). At the time limit it sends SIGTERM to the process group (the supervisor then stops
its child, which checkpoints), and SIGKILL after a grace.

:class:`Neighbours` records which other card commands run at the same time on this host (a file
each under the cache with its start and end), so the table can say how many shared the GPU with
a measurement.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import psutil

#: After SIGTERM at the time limit: the supervisor's stop_grace (20 s in the bench's jobs) plus margin.
TERM_GRACE_S = 30.0
SAMPLE_S = 0.5


@dataclasses.dataclass(frozen=True)
class Launch:
    """How one process ended. ``started_at`` is wall-clock time (the events files' clock)."""

    argv: tuple[str, ...]
    exit_code: int | None
    timed_out: bool
    started_at: float
    wall_s: float
    cpu_s: float | None  # the process's own user + system time, children excluded
    peak_rss: int | None  # bytes (VmHWM)


def _high_water(pid: int) -> int | None:
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status", encoding="ascii") as handle:
        for line in handle:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


class _Sampler:
    """The latest CPU time and the highest RSS seen of one process (its own, not its children's)."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.cpu_s: float | None = None
        self.peak_rss: int | None = None

    def sample(self) -> None:
        with contextlib.suppress(psutil.Error):
            times = self.process.cpu_times()
            self.cpu_s = round(times.user + times.system, 2)
            rss = _high_water(self.process.pid) or self.process.memory_info().rss
            self.peak_rss = max(self.peak_rss or 0, rss)


def _stop(proc: subprocess.Popen[bytes]) -> int:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        return proc.wait(timeout=TERM_GRACE_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        return proc.wait()


def launch(argv: Sequence[str], log: Path, limit_s: float, env: Mapping[str, str] | None = None) -> Launch:
    """Run ``argv`` (output to ``log``, its own session) until it exits or ``limit_s`` passes."""
    log.parent.mkdir(parents=True, exist_ok=True)
    started_at, t0 = time.time(), time.monotonic()
    with log.open("ab") as out:
        proc = subprocess.Popen(
            list(argv),
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=dict(env) if env is not None else None,
        )
    sampler = _Sampler(proc.pid)
    timed_out = False
    code: int | None = None
    while code is None:
        sampler.sample()  # before the wait: a zombie has no status file left to read
        try:
            code = proc.wait(timeout=SAMPLE_S)
        except subprocess.TimeoutExpired:
            if time.monotonic() - t0 >= limit_s:
                timed_out = True
                code = _stop(proc)
    return Launch(
        tuple(argv),
        code,
        timed_out,
        started_at,
        round(time.monotonic() - t0, 1),
        sampler.cpu_s,
        sampler.peak_rss,
    )


class Neighbours:
    """A file per card command in ``cache/running`` with its start and, once it leaves, its end;
    :meth:`overlapping` counts the other commands that ran at some time in an interval."""

    def __init__(self, cache: Path, name: str) -> None:
        self.directory = cache / "running"
        self.directory.mkdir(parents=True, exist_ok=True)
        self.mine = self.directory / f"{name}.{os.getpid()}.json"
        self.start = time.time()
        self._write(None)

    def _write(self, end: float | None) -> None:
        record = {"pid": os.getpid(), "start": self.start, "end": end}
        self.mine.write_text(json.dumps(record), encoding="utf-8")

    def overlapping(self, since: float, until: float) -> int:
        """Other commands running at some time between the wall-clock times ``since`` and ``until``."""
        count = 0
        for path in self.directory.glob("*.json"):
            with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
                other = json.loads(path.read_text(encoding="utf-8"))
                if path == self.mine or (other["end"] is None and not psutil.pid_exists(other["pid"])):
                    continue  # ourselves, or one killed before it could say when it ended
                if other["start"] < until and (other["end"] is None or other["end"] > since):
                    count += 1
        return count

    def leave(self) -> None:
        self._write(time.time())
