"""Optional outputs are best-effort: the metrics textfile, the ``on_event`` hook (here), sd_notify, the
console. None may stop training, raise into the loop (where an ``OSError`` would read as the run disk
being full) or flood the log: a failure is ``output_failed`` once (the hook's ``hook_failed``), again at
most every :data:`RELOG_EVERY_S` with the unlogged count, and ``output_recovered`` when it works again.
:class:`Reporter` is the loop's one hook into reporting: each tick's progress goes to the console,
systemd and metrics; events reach the metrics and the hook through the event log's listeners, so the
loop knows nothing of tqdm, sd_notify or Prometheus."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, write_to_textfile
from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.jobfile.world import NOT_PROM
from qlora_supervise.supervisor.record.eventlog import Listener
from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.reporting.console import PaceMeter, ProgressDisplay
from qlora_supervise.supervisor.reporting.notify import ServiceStatus
from qlora_supervise.supervisor.watching.watch import Progress

METRICS_TEXTFILE = "supervise.metrics_textfile"
ON_EVENT = "supervise.on_event"
SYSTEMD = "systemd notify"
CONSOLE = "console"  # stderr's log lines and progress, stdout's summary (console.ConsoleStream)
#: What a person does about each output's failure; the run goes on either way.
FIXES = {
    METRICS_TEXTFILE: "the run goes on without metrics; free space or make the textfile's directory "
    "writable (or remove supervise.metrics_textfile)",
    ON_EVENT: "the run goes on; fix supervise.on_event (try it with a JSON line on stdin)",
    SYSTEMD: "the run goes on; systemctl status may show an old line until the socket answers again",
    CONSOLE: "the run goes on without console lines (its reader or terminal went away); events.jsonl "
    "has every event and `qlora-supervise status RUN_DIR` the state",
}
#: A failing output is logged again at most this often (with the count of unlogged failures).
RELOG_EVERY_S = 600.0


@dataclass
class _Failing:
    logged_at: float
    failures: int = 1
    unlogged: int = 0


class BestEffort:
    """Runs optional outputs so that none can stop the run. ``log`` is bound once the event log
    exists; a failure before that is not remembered, so the first one after binding is logged."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.log: FilteringBoundLogger | None = None
        self._clock = clock
        self._failing: dict[str, _Failing] = {}

    def run(self, output: str, action: Callable[[], object]) -> bool:
        """``action()``; False when it raised (logged, never raised). ``action`` returning False means
        nothing was due: that neither fails nor recovers the output."""
        try:
            done = action()
        # Blind on purpose: an optional output may fail in any way (OSError from a full or read-only textfile,
        # a ValueError from prometheus_client, a bug in a listener), and none of those may reach the loop.
        except Exception as error:
            self.failed(output, f"{type(error).__name__}: {error}")
            return False
        if done is not False:
            self.worked(output)
        return True

    def listener(self, output: str, listener: Callable[[Mapping[str, object]], object]) -> Listener:
        def guarded(event: Mapping[str, object]) -> None:
            self.run(output, lambda: listener(event))

        return guarded

    def failed(self, output: str, problem: str, event: Event = Event.OUTPUT_FAILED, **fields: object) -> None:
        now = self._clock()
        if (streak := self._failing.get(output)) is not None:
            streak.failures += 1
            if now - streak.logged_at < RELOG_EVERY_S:
                streak.unlogged += 1
                return
        if self.log is None:
            return
        self._failing[output] = _Failing(now, 1 if streak is None else streak.failures)
        more = {"unlogged_failures": streak.unlogged} if streak is not None else {}
        self.log.warning(event, output=output, problem=problem, fix=FIXES.get(output, ""), **more, **fields)

    def worked(self, output: str) -> None:
        if (streak := self._failing.pop(output, None)) is not None and self.log is not None:
            self.log.info(Event.OUTPUT_RECOVERED, output=output, failures=streak.failures)


HOOKED_EVENTS = frozenset({Event.RETRY.value, Event.GAVE_UP.value, Event.RUN_SUCCEEDED.value})
#: Of each of the hook's stdout and stderr, only the last lines are kept (for the log): a hook printing
#: a gigabyte cost 2.9 GB before.
KEEP_BYTES = 64 * 1024


class EventHook:
    """``supervise.on_event``: runs ``argv`` (no shell) for each hooked event, with the event's JSON line
    on stdin and ``QLORA_SUPERVISE_EVENT`` set, to completion or ``timeout_s`` before the loop goes on
    (so its order with the run's actions is fixed); its failures go to ``outputs``."""

    def __init__(self, argv: Sequence[str], timeout_s: float, outputs: BestEffort | None = None) -> None:
        self.argv, self.timeout_s, self.outputs = list(argv), timeout_s, outputs or BestEffort()

    @property
    def log(self) -> FilteringBoundLogger | None:
        return self.outputs.log

    @log.setter
    def log(self, log: FilteringBoundLogger | None) -> None:
        self.outputs.log = log

    def on_event(self, event: Mapping[str, object]) -> bool:
        """Run the hook for a hooked event; True when it ran and exited 0 (a failure is logged here)."""
        if (name := str(event.get("event"))) not in HOOKED_EVENTS:
            return False
        if (problem := self._run(name, json.dumps(dict(event), default=str))) is None:
            self.outputs.worked(ON_EVENT)
        else:
            self.outputs.failed(ON_EVENT, problem, Event.HOOK_FAILED, hook=self.argv, for_event=name)
        return problem is None

    def _run(self, name: str, payload: str) -> str | None:
        env = {**os.environ, "QLORA_SUPERVISE_EVENT": name}
        try:
            code, out, err = bounded_run(self.argv, payload.encode(), self.timeout_s, env)
        except OSError as error:
            return f"could not start: {error}"
        if code is None:
            return f"timed out after {self.timeout_s:g}s (killed)"
        tail = (err or out).decode("utf-8", "replace").strip().splitlines()[-1:] or [""]
        return f"exit status {code}: {tail[0][:300]}" if code != 0 else None


def bounded_run(
    argv: Sequence[str], payload: bytes, timeout_s: float, env: Mapping[str, str]
) -> tuple[int | None, bytes, bytes]:
    """Run ``argv`` with ``payload`` on stdin: its exit status (None: killed at the timeout) and the
    last :data:`KEEP_BYTES` of its stdout and stderr. Raises OSError when it cannot start."""
    pipe = subprocess.PIPE
    proc = subprocess.Popen(argv, stdin=pipe, stdout=pipe, stderr=pipe, env=env)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None  # all piped
    out, err, stdin_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
    tails = {out: bytearray(), err: bytearray()}
    deadline = time.monotonic() + timeout_s
    pending = memoryview(payload)
    with selectors.DefaultSelector() as selector:
        selector.register(proc.stdout, selectors.EVENT_READ)
        selector.register(proc.stderr, selectors.EVENT_READ)
        os.set_blocking(stdin_fd, False)
        selector.register(proc.stdin, selectors.EVENT_WRITE)
        while selector.get_map() and (left := deadline - time.monotonic()) > 0:
            for key, _ in selector.select(left):
                if key.fd == stdin_fd:  # what stdin takes now; closed once all is written
                    try:
                        pending = pending[os.write(stdin_fd, pending) :]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        pending = pending[:0]  # the hook does not read its stdin: the rest is dropped
                    if not pending:
                        selector.unregister(proc.stdin)
                        proc.stdin.close()
                elif chunk := os.read(key.fd, 65536):
                    tails[key.fd] += chunk
                    del tails[key.fd][:-KEEP_BYTES]
                else:
                    selector.unregister(key.fd)
    try:  # the exit status, or None after a kill at the deadline; its pipes closed either way
        code: int | None = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        stream.close()  # a no-op on one already closed
    return code, bytes(tails[out]), bytes(tails[err])


STATES = ("starting", "running", "backoff", "waiting", "succeeded", "gave_up", "stopped")
_STATE_OF_EVENT = {
    Event.ATTEMPT_STARTED.value: "running",
    Event.BACKOFF.value: "backoff",
    Event.WAITING_FOR_MEMORY.value: "waiting",
    Event.RUN_SUCCEEDED.value: "succeeded",
    Event.GAVE_UP.value: "gave_up",
    Event.STOPPED.value: "stopped",
}
_Metric = TypeVar("_Metric", Counter, Gauge)
#: Progress is written at most this often; events (a retry, the verdict) are written at once.
WRITE_EVERY_S = 10.0


class MetricsTextfile:
    """The run's Prometheus metrics (``supervise.metrics_textfile``; off by default), label ``run``: the
    output_dir's name, rewritten atomically to ``path`` (``.prom``) from the first :meth:`write`. A
    node_exporter textfile, not an HTTP endpoint: an endpoint would need a port and a server thread per
    job, and would vanish with the process, verdict and all; the file keeps its last state."""

    def __init__(self, path: Path, run: str, budget_bytes: int | None) -> None:
        if path.suffix != ".prom":
            raise ValueError(f"{path}: {NOT_PROM}")
        self.path = path
        self.registry = CollectorRegistry()
        self._attempts = self._metric(
            Counter, "attempts", "Attempts that ended, by outcome and failure kind", "outcome", "kind"
        )
        doc = (
            "Planned restarts to a faster config: step_up (a rung's cause cleared), retime (the trial again)"
        )
        self._planned = self._metric(Counter, "planned_restarts", doc, "kind")
        self._step = self._metric(Gauge, "step", "Last completed optimizer step")
        self._max_steps = self._metric(Gauge, "max_steps", "Steps the run trains to")
        self._tokens = self._metric(Gauge, "tokens_per_second", "Training throughput of this attempt")
        self._peak = self._metric(Gauge, "peak_bytes", "Peak memory of this attempt (what its cap limits)")
        self._budget = self._metric(Gauge, "budget_bytes", "The memory cap the job gives the trainer")
        self._attempt = self._metric(Gauge, "attempt", "The attempt number running now")
        self._state = Enum(
            "qlora_supervise_state", "Supervisor state", ["run"], states=list(STATES), registry=self.registry
        )
        self._run, self._written_at = run, -1e18
        self._state.labels(run).state("starting")
        if budget_bytes is not None:
            self._budget.labels(run).set(budget_bytes)

    def _metric(self, kind: type[_Metric], name: str, doc: str, *labels: str) -> _Metric:
        return kind(f"qlora_supervise_{name}", doc, ["run", *labels], registry=self.registry)

    def progress(self, attempt: int, p: Progress, now: float) -> bool:
        """The attempt's progress, written every :data:`WRITE_EVERY_S`; False when no write was due."""
        run = self._run
        self._attempt.labels(run).set(attempt)
        self._step.labels(run).set(p.step)
        if p.max_steps:
            self._max_steps.labels(run).set(p.max_steps)
        if p.tokens_per_s is not None:
            self._tokens.labels(run).set(p.tokens_per_s)
        if p.peak_bytes:
            self._peak.labels(run).set(p.peak_bytes)
        if now - self._written_at < WRITE_EVERY_S:
            return False
        self._written_at = now  # first: a failing write is tried again in WRITE_EVERY_S, not every tick
        self.write()
        return True

    def on_event(self, event: Mapping[str, object]) -> bool:
        """Attempt outcomes and state changes, written at once; False for an event not counted."""
        if (name := str(event.get("event"))) == Event.FAILURE_CLASSIFIED.value:
            self._attempts.labels(self._run, "failed", str(event.get("kind"))).inc()
        elif name == Event.ATTEMPT_SUCCEEDED.value:
            self._attempts.labels(self._run, "succeeded", "none").inc()
        elif name in (Event.STEP_UP.value, Event.RETIME.value):
            self._planned.labels(self._run, name).inc()
        elif name not in _STATE_OF_EVENT:
            return False
        if name in _STATE_OF_EVENT:
            self._state.labels(self._run).state(_STATE_OF_EVENT[name])
        self.write()
        return True

    def write(self) -> None:
        """The whole file, atomically. Raises what the file system raises."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_to_textfile(str(self.path), self.registry)


class Reporter:
    """Fans one attempt's progress out to the console, sd_notify and (when on) the metrics file."""

    def __init__(
        self,
        display: ProgressDisplay,
        service: ServiceStatus | None = None,
        metrics: MetricsTextfile | None = None,
        outputs: BestEffort | None = None,
    ) -> None:
        self.display, self.service, self.metrics = display, service, metrics
        self.outputs = outputs or BestEffort()
        self._pace = PaceMeter()

    def update(self, attempt: int, progress: Progress, now: float) -> None:
        pace = self._pace.measure(attempt, progress, now)
        self.display.update(attempt, progress, pace)
        service, metrics = self.service, self.metrics
        if service is not None:
            self.outputs.run(SYSTEMD, lambda: service.update(attempt, progress, pace, now))
        if metrics is not None:
            self.outputs.run(METRICS_TEXTFILE, lambda: metrics.progress(attempt, progress, now))

    def bind(self, log: FilteringBoundLogger) -> None:
        """The event log exists: output failures go there; the metrics file gets its first state."""
        self.outputs.log = log
        if self.metrics is not None:
            self.outputs.run(METRICS_TEXTFILE, self.metrics.write)

    def clear(self) -> None:
        self.display.clear()
