"""The person's side of the structured log: readable lines, local times, journald priorities.

Each event's level becomes a syslog priority (``journalctl -p warning`` shows the retries and
give-ups): under journald (``$JOURNAL_STREAM``) as sd-daemon's ``<N>`` prefix, which journald strips
and stamps itself; elsewhere the line starts with the local time."""

from __future__ import annotations

import os
import time
from typing import TextIO

import structlog
from structlog.typing import EventDict, WrappedLogger

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
        view = _console_view(event_dict)
        stamp = view.pop("time", None)
        if not self._journald and isinstance(stamp, int | float):
            view["timestamp"] = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(stamp))
        text = str(self._render(logger, method, view))
        if not self._journald:
            return text
        prefix = f"<{PRIORITY.get(str(event_dict.get('level', method)), 6)}>"
        return "\n".join(prefix + line for line in text.splitlines())


def _console_view(event_dict: EventDict) -> EventDict:
    # Nested numbers and knobs are for tools; the console shows the flat fields and the "why".
    return {k: v for k, v in event_dict.items() if not isinstance(v, dict | list) or k == "changes"}
