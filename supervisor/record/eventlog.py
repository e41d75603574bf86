"""The supervisor's structured log: JSON lines in ``events.jsonl`` (``{"event", "level", "time",
...fields}``, names from :class:`~.events.Event`), readable lines on the console (local times, or
journald priorities under ``$JOURNAL_STREAM``). A line a listener logs itself comes after the event
it reacts to, in the file and on the console, and is not handed to the listeners again."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

import structlog
from structlog.typing import EventDict, FilteringBoundLogger, WrappedLogger

from qlora_supervise.supervisor.facts.append import open_append_text
from qlora_supervise.trainer_child.contract.disk_space import DISK_ERRNOS

#: syslog priorities (sd-daemon.h): err 3, warning 4, info 6, debug 7.
PRIORITY = {"critical": 2, "exception": 3, "error": 3, "warning": 4, "warn": 4, "info": 6, "debug": 7}


def under_journald(stream: TextIO | None) -> bool:
    """True when ``stream`` is the journal stream systemd connected (``JOURNAL_STREAM=dev:inode``)."""
    value = os.environ.get("JOURNAL_STREAM", "")
    if stream is None or ":" not in value:
        return False
    try:
        info = os.fstat(stream.fileno())
    except (OSError, ValueError, AttributeError):  # a StringIO in tests, a closed stream
        return False
    return value == f"{info.st_dev}:{info.st_ino}"


class ConsoleLines:
    """Renders one event for a person; ``level`` decides the journald priority prefix."""

    def __init__(self, stream: TextIO | None) -> None:
        self._journald = under_journald(stream)
        colors = bool(stream is not None and stream.isatty() and not self._journald)
        self._render = structlog.dev.ConsoleRenderer(colors=colors, timestamp_key="timestamp")

    def render(self, logger: WrappedLogger, method: str, event_dict: EventDict) -> str:
        # Nested numbers and knobs are for tools; the console shows the flat fields and the "why".
        view = {k: v for k, v in event_dict.items() if not isinstance(v, dict | list) or k == "changes"}
        stamp = view.pop("time", None)
        if not self._journald and isinstance(stamp, int | float):
            view["timestamp"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))
        text = str(self._render(logger, method, view))
        if not self._journald:
            return text
        prefix = f"<{PRIORITY.get(str(event_dict.get('level', method)), 6)}>"
        return "\n".join(prefix + line for line in text.splitlines())


_HELD_MAX = 10_000  # lines held for a full disk before the oldest are dropped
#: Receives each event after its line is written (``MetricsTextfile.on_event``, ``EventHook.on_event``).
Listener = Callable[[Mapping[str, object]], None]


class _EventsFile:
    """Processor: appends the event's JSON line to ``events.jsonl`` and passes the event on."""

    def __init__(self, events_path: Path) -> None:
        events_path.parent.mkdir(parents=True, exist_ok=True)
        self._path = events_path
        self._file = open_append_text(events_path)
        self._held: list[str] = []  # lines a full disk did not take yet
        self._json = structlog.processors.JSONRenderer(default=str)

    def __call__(self, logger: WrappedLogger, method: str, event_dict: EventDict) -> EventDict:
        """Append the line; a full disk holds it (and later ones) until there is room: never raises."""
        self._held.append(str(self._json(logger, method, dict(event_dict))) + "\n")
        try:
            self._file.write("".join(self._held))
            self._file.flush()
        except OSError as exc:
            if exc.errno not in DISK_ERRNOS:
                raise
            # A failed flush may leave part of a line in the buffer or the file: start from a clean one.
            with contextlib.suppress(OSError):
                self._file.close()
            self._file = open_append_text(self._path)
            self._file.write("\n")  # closes a torn line, if any, so the next one stands alone
            del self._held[:-_HELD_MAX]
        else:
            self._held.clear()
        return event_dict


class _Relay:
    """Final processor: runs the listeners, then returns the console line for ``WriteLogger``. A line
    logged *by* a listener is held and written after the outer event's own line, so the console keeps
    the file's order. Without a console the event ends here (``DropEvent``)."""

    def __init__(self, console: TextIO | None, listeners: Sequence[Listener]) -> None:
        self._lines = ConsoleLines(console) if console is not None else None
        self._listeners = tuple(listeners)
        self._depth = 0  # > 0 while listeners run
        self._held: list[str] = []  # console lines the listeners logged, for after the outer line

    def __call__(self, logger: WrappedLogger, method: str, event_dict: EventDict) -> str:
        if not (nested := self._depth > 0):
            self._depth += 1
            try:
                for listener in self._listeners:
                    listener(event_dict)
            finally:
                self._depth -= 1
        text = "" if self._lines is None else self._lines.render(logger, method, event_dict)
        if nested:
            self._held.append(text)
            raise structlog.DropEvent
        lines = [line for line in (text, *self._held) if line]
        self._held.clear()
        if not lines:
            raise structlog.DropEvent
        return "\n".join(lines)


def open_event_log(
    events_path: Path, console: TextIO | None = sys.stderr, listeners: Sequence[Listener] = ()
) -> FilteringBoundLogger:
    """A structlog logger bound to this run's events file (and the console when given)."""
    log: FilteringBoundLogger = structlog.wrap_logger(
        structlog.WriteLogger(console) if console is not None else structlog.ReturnLogger(),
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt=None, key="time"),
            _EventsFile(events_path),
            _Relay(console, listeners),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
    )
    return log


def read_events(events_path: Path) -> list[dict[str, Any]]:
    """The events of a run (a torn last line is skipped)."""
    events: list[dict[str, Any]] = []
    for line in events_path.read_text(encoding="utf-8").splitlines() if events_path.is_file() else []:
        with contextlib.suppress(ValueError):  # a torn last line
            events.append(json.loads(line))
    return events
