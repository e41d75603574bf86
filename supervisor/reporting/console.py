"""Progress on the console: a redrawn bar on a terminal, plain lines otherwise (logs, systemd)."""

from __future__ import annotations

from typing import TextIO

from qlora_supervise.supervisor.jobfile.units import format_bytes
from qlora_supervise.supervisor.watching.heartbeats import Progress

_BAR_WIDTH = 24


class ProgressDisplay:
    def __init__(self, stream: TextIO, plain: bool, plain_every_s: float = 30.0) -> None:
        self._stream = stream
        self._tty = stream.isatty() and not plain
        self._plain_every_s = plain_every_s
        self._last_plain = -1e18
        self._last_key: tuple[int, int, str] | None = None
        self._drawn = False

    def update(self, attempt: int, progress: Progress, now: float) -> None:
        key = (attempt, progress.step, progress.stage)
        if self._tty:
            self._stream.write("\r" + self._bar(attempt, progress) + "\x1b[K")
            self._stream.flush()
            self._drawn = True
        elif key != self._last_key and now - self._last_plain >= self._plain_every_s:
            print(self._line(attempt, progress), file=self._stream, flush=True)
            self._last_plain = now
        self._last_key = key

    def clear(self) -> None:
        """End the redrawn line before a log line is printed."""
        if self._drawn:
            self._stream.write("\r\x1b[K")
            self._stream.flush()
            self._drawn = False

    def _bar(self, attempt: int, p: Progress) -> str:
        total = p.max_steps or 0
        filled = int(_BAR_WIDTH * p.step / total) if total else 0
        bar = "#" * filled + "-" * (_BAR_WIDTH - filled)
        return f"attempt {attempt} [{bar}] {self._line(attempt, p, with_attempt=False)}"

    @staticmethod
    def _line(attempt: int, p: Progress, with_attempt: bool = True) -> str:
        parts = [f"attempt {attempt}"] if with_attempt else []
        parts.append(f"step {p.step}/{p.max_steps or '?'}")
        parts.append(p.stage)
        if p.loss is not None:
            parts.append(f"loss {p.loss:.4f}")
        if p.tokens_per_s is not None:
            parts.append(f"{p.tokens_per_s:.0f} tok/s")
        if p.peak_bytes:
            parts.append(f"peak {format_bytes(p.peak_bytes)}")
        return " | ".join(parts)
