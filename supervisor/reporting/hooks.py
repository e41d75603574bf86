"""``supervise.on_event``: a lab's own command, run on ``retry``, ``gave_up`` and ``run_succeeded``.

An argv list, no shell, the event's JSON line on stdin and ``QLORA_SUPERVISE_EVENT`` set. It runs to
completion or ``supervise.on_event_timeout`` before the loop goes on, so its order with the run's
actions is fixed; a failure is logged through :class:`~.outputs.BestEffort` and never changes the run.
Only the last :data:`KEEP_BYTES` of each stream are kept: a hook printing a gigabyte cost 2.9 GB before."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import time
from collections.abc import Mapping, Sequence
from typing import IO

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.reporting.outputs import ON_EVENT, BestEffort

HOOKED_EVENTS = frozenset({Event.RETRY.value, Event.GAVE_UP.value, Event.RUN_SUCCEEDED.value})
ENV_EVENT = "QLORA_SUPERVISE_EVENT"
KEEP_BYTES = 64 * 1024  # of each of the hook's stdout and stderr: its last lines, for the log


class EventHook:
    """Runs ``argv`` for each hooked event; its failures go to ``outputs`` (``log``: ``outputs.log``)."""

    def __init__(self, argv: Sequence[str], timeout_s: float, outputs: BestEffort | None = None) -> None:
        self.argv = list(argv)
        self.timeout_s = timeout_s
        self.outputs = outputs or BestEffort()

    @property
    def log(self) -> FilteringBoundLogger | None:
        return self.outputs.log

    @log.setter
    def log(self, log: FilteringBoundLogger | None) -> None:
        self.outputs.log = log

    def on_event(self, event: Mapping[str, object]) -> bool:
        """Run the hook for a hooked event; True when it ran and exited 0 (a failure is logged here)."""
        name = str(event.get("event"))
        if name not in HOOKED_EVENTS:
            return False
        problem = self._run(name, json.dumps(dict(event), default=str))
        if problem is None:
            self.outputs.worked(ON_EVENT)
            return True
        self.outputs.failed(ON_EVENT, problem, Event.HOOK_FAILED, hook=self.argv, for_event=name)
        return False

    def _run(self, name: str, payload: str) -> str | None:
        """None when the hook exited 0, else what went wrong, in one line."""
        env = {**os.environ, ENV_EVENT: name}
        try:
            code, out, err = bounded_run(self.argv, payload.encode(), self.timeout_s, env)
        except OSError as error:
            return f"could not start: {error}"
        if code is None:
            return f"timed out after {self.timeout_s:g}s (killed)"
        if code != 0:
            text = (err or out).decode("utf-8", "replace")
            tail = text.strip().splitlines()[-1:] or [""]
            return f"exit status {code}: {tail[0][:300]}"
        return None


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
                if key.fd == stdin_fd:
                    pending = _feed(proc.stdin, pending, selector)
                else:
                    _drain(key.fd, tails[key.fd], selector)
    code = _wait(proc, deadline)
    return code, bytes(tails[out]), bytes(tails[err])


def _feed(stdin: IO[bytes], pending: memoryview, selector: selectors.BaseSelector) -> memoryview:
    """Write what the hook's stdin takes now; close it once all is written (or the hook stopped reading)."""
    try:
        pending = pending[os.write(stdin.fileno(), pending) :]
    except BlockingIOError:
        return pending
    except BrokenPipeError:
        pending = pending[:0]  # the hook does not read its stdin: the rest is dropped
    if not pending:
        selector.unregister(stdin)
        stdin.close()
    return pending


def _drain(fd: int, tail: bytearray, selector: selectors.BaseSelector) -> None:
    """Read a chunk of one of the hook's streams; keep only its last KEEP_BYTES."""
    chunk = os.read(fd, 65536)
    if not chunk:
        selector.unregister(fd)
        return
    tail += chunk
    if len(tail) > KEEP_BYTES:
        del tail[: len(tail) - KEEP_BYTES]


def _wait(proc: subprocess.Popen[bytes], deadline: float) -> int | None:
    """The hook's exit status, or None after a kill at the deadline; its pipes closed either way."""
    try:
        code: int | None = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        code = None
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None and not stream.closed:
            stream.close()
    return code
