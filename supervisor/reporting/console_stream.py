"""The console is a best-effort output: a closed pipe or terminal costs the console, not the run.

Under ``run job.yaml | tee log`` a Ctrl-C ends ``tee`` first, and the next console line failed with
``EPIPE`` mid-stop (issue 29 item 10: exit 141, not 130, the stop never journaled). So every console
write goes through :class:`ConsoleStream`: the first failure turns the console off, points the fd at
``/dev/null`` (for the interpreter's flush at exit) and is logged once as ``output_failed``."""

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
