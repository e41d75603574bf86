"""The console is a best-effort output: a closed pipe or terminal costs the console, not the run.

Under ``qlora-supervise run job.yaml | tee log`` a Ctrl-C reaches ``tee`` as well, which exits
first; the supervisor's next console line then fails with ``EPIPE`` (a closed terminal: ``EIO``)
in the middle of its graceful stop, and an exception there ended it before the stop was
journaled (issue 29 item 10: exit 141, not 130, and ``status`` said "running"). So every console
write (the log lines, the progress, the summary) goes through :class:`ConsoleStream`: the first
failure turns the console off for the rest of the process, points the file descriptor at
``/dev/null`` (so the interpreter's own flush at exit, and anything else writing there, finds
nothing to fail on) and is logged once as ``output_failed`` (output ``console``, see :mod:`.outputs`) in
``events.jsonl``; the run, its stop and its exit code go on as if the console were there.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import TextIO, cast


class ConsoleStream(io.TextIOBase):
    """``stream`` for as long as it takes writes; then nothing (module docstring)."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream = stream
        self.lost: str | None = None  # why the console went away (None: it is there)
        self._reported = False

    def write(self, text: str) -> int:
        if self.lost is None:
            try:
                self._stream.write(text)
                self._stream.flush()
            except (OSError, ValueError) as error:  # EPIPE, EIO; ValueError: a closed file
                self._lose(error)
        return len(text)

    def flush(self) -> None:
        if self.lost is None:
            try:
                self._stream.flush()
            except (OSError, ValueError) as error:
                self._lose(error)

    def isatty(self) -> bool:
        with contextlib.suppress(OSError, ValueError):
            return self.lost is None and self._stream.isatty()
        return False

    def fileno(self) -> int:
        return self._stream.fileno()

    def check(self) -> bool:
        """For the event log's listeners: raises once, the first time after the console went away
        (so :class:`~.outputs.BestEffort` logs it), and is a no-op (False) otherwise."""
        if self.lost is None or self._reported:
            return False
        self._reported = True
        raise ConsoleLost(self.lost)

    def _lose(self, error: BaseException) -> None:
        self.lost = f"{type(error).__name__}: {error}"
        with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation, AttributeError):
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)


class ConsoleLost(OSError):
    """The console stopped taking writes (its reader or terminal went away)."""


def best_effort(stream: TextIO) -> tuple[TextIO, ConsoleStream]:
    """``stream`` wrapped as a :class:`ConsoleStream`: as a ``TextIO`` for its writers (the
    wrapper has the methods they call: write, flush, isatty, fileno), and as itself."""
    console = stream if isinstance(stream, ConsoleStream) else ConsoleStream(stream)
    return cast(TextIO, console), console
