"""The supervisor's structured log: JSON lines in ``events.jsonl``, readable lines on the console.

Each line is one JSON object: ``{"event": <name>, "level": "info", "time": <epoch seconds>,
...fields}``. Event names come from one vocabulary, :class:`~.events.Event`. structlog does the
work as its authors mean it: ``bind()`` carries context (``attempt=3``) onto every later line,
``TimeStamper`` stamps, ``JSONRenderer`` writes the file line and ``ConsoleRenderer`` the
person's line (:class:`~qlora_supervise.supervisor.reporting.console_log.ConsoleLines`: local
times, journald priorities); the last processor tees the two and then hands the event to the
listeners (metrics, the ``on_event`` hook), after the line is written, so a listener that logs
(a failing hook) adds its line after the one it reacts to.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import structlog

from qlora_supervise.supervisor.record.runfiles import open_append_text
from qlora_supervise.supervisor.reporting.console_log import ConsoleLines
from qlora_supervise.trainer_child.contract.disk_space import DISK_ERRNOS

_HELD_MAX = 10_000  # lines held for a full disk before the oldest are dropped

#: Receives each event after its line is written (``MetricsTextfile.on_event``, ``EventHook.on_event``).
Listener = Callable[[Mapping[str, Any]], None]


class _Tee:
    """Final processor: one JSON line to the events file, a readable line to the console."""

    def __init__(self, events_path: Path, console: TextIO | None, listeners: Sequence[Listener]) -> None:
        events_path.parent.mkdir(parents=True, exist_ok=True)
        self._path = events_path
        self._file = open_append_text(events_path)
        self._held: list[str] = []  # lines a full disk did not take yet
        self._console = console
        self._json = structlog.processors.JSONRenderer(default=str)
        self._lines = ConsoleLines(console)
        self._listeners = tuple(listeners)

    def __call__(self, logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> str:
        self._write(str(self._json(logger, method, dict(event_dict))) + "\n")
        if self._console is not None:
            print(self._lines.render(logger, method, event_dict), file=self._console, flush=True)
        for listener in self._listeners:
            listener(event_dict)
        return ""  # printed above, before the listeners run

    def _write(self, line: str) -> None:
        """Append ``line``; on a full disk hold it (and those after it) until there is room again.

        Logging must never raise into the loop: the supervisor's answer to a full disk is to
        wait for room, and it says so in events it cannot write yet.
        """
        self._held.append(line)
        try:
            self._file.write("".join(self._held))
            self._file.flush()
        except OSError as exc:
            if exc.errno not in DISK_ERRNOS:
                raise
            self._drop_partial()
            del self._held[:-_HELD_MAX]
            return
        self._held.clear()

    def _drop_partial(self) -> None:
        # A failed flush may leave part of a line in the buffer or the file: start from a clean
        # buffer (held lines are rewritten whole; a torn line in the file is skipped on read).
        with contextlib.suppress(OSError):
            self._file.close()
        self._file = open_append_text(self._path)
        self._file.write("\n")  # closes a torn line, if any, so the next one stands alone

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._file.close()


class _Console:
    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream

    def msg(self, message: str) -> None:
        if self._stream is not None and message:
            print(message, file=self._stream, flush=True)

    info = warning = error = msg


def open_event_log(
    events_path: Path, console: TextIO | None = sys.stderr, listeners: Sequence[Listener] = ()
) -> Any:
    """A structlog logger bound to this run's events file (and the console when given)."""
    tee = _Tee(events_path, console, listeners)
    return structlog.wrap_logger(
        _Console(console),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt=None, key="time"),
            tee,
        ],
        wrapper_class=structlog.BoundLogger,
    )


def read_events(events_path: Path) -> list[dict[str, Any]]:
    """The events of a run (a torn last line is skipped)."""
    events: list[dict[str, Any]] = []
    if not events_path.is_file():
        return events
    for line in events_path.read_text(encoding="utf-8").splitlines():
        try:
            events.append(json.loads(line))
        except ValueError:
            continue
    return events
