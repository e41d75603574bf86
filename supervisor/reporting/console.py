"""The console: progress as a tqdm bar on a terminal, one plain line per logging step otherwise (times as
tqdm prints them, ``2:10:00``); the attempt's pace; and the console as a best-effort stream."""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn, TextIO, cast

from tqdm import tqdm

from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.watching.watch import Progress

_TRAINING = frozenset({"forward", "backward", "optimizer"})


class ProgressDisplay:
    """Draws one attempt's progress (the bar starts at the resume step, so its rate and ETA count only
    this attempt; plain: a line at each multiple of ``logging_steps`` and at a stage change);
    :meth:`clear` ends the bar before a log line."""

    def __init__(self, stream: TextIO, plain: bool, logging_steps: int = 1) -> None:
        self._stream, self._tty, self._every = stream, stream.isatty() and not plain, max(1, logging_steps)
        self._bar: tqdm[NoReturn] | None = None  # a bar with no iterable: fed by update()
        self._last_key: tuple[int, int, str] | None = None

    def update(self, attempt: int, progress: Progress, pace: Pace) -> None:
        key = (attempt, progress.step, progress.stage)
        if self._tty:
            if self._bar is None:
                self._bar = tqdm(
                    total=progress.max_steps,
                    initial=progress.step,
                    desc=f"attempt {attempt}",
                    unit="step",
                    file=self._stream,
                    dynamic_ncols=True,
                )
            self._bar.set_postfix_str(_postfix(progress), refresh=False)
            if progress.step > self._bar.n:
                self._bar.update(progress.step - self._bar.n)  # redraws at tqdm's own rate limit
            else:
                self._bar.refresh()
        elif key != self._last_key and self._worth_a_line(progress):
            print(plain_line(attempt, progress, pace), file=self._stream, flush=True)
        self._last_key = key

    def clear(self) -> None:
        """End the bar (its last state stays on screen) so the next log line starts clean."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _worth_a_line(self, p: Progress) -> bool:
        if (last := self._last_key) is None:
            return True
        # forward -> backward -> optimizer every step is not news; load, save, eval and merge are.
        if last[2] != p.stage and not (p.stage in _TRAINING and last[2] in _TRAINING):
            return True
        return p.step != last[1] and (p.step % self._every == 0 or p.step == p.max_steps)


def _postfix(p: Progress) -> str:
    loss = [] if p.loss is None else [f"loss {p.loss:.4f}"]
    rate = [] if p.tokens_per_s is None else [f"{p.tokens_per_s:.0f} tok/s"]
    peak = [f"peak {format_bytes(p.peak_bytes)}"] if p.peak_bytes else []
    return " | ".join([p.stage, *loss, *rate, *peak])


def plain_line(attempt: int, p: Progress, pace: Pace) -> str:
    """``attempt 2 | step 40/100 | forward | loss 1.2345 | 1893 tok/s | 03:10 elapsed, ETA 04:45``."""
    eta = "" if pace.eta_s is None else f", ETA {tqdm.format_interval(pace.eta_s)}"
    timing = f"{tqdm.format_interval(pace.elapsed_s)} elapsed{eta}"
    return " | ".join([f"attempt {attempt}", f"step {p.step}/{p.max_steps or '?'}", _postfix(p), timing])


@dataclass(frozen=True)
class Pace:
    """An attempt's pace at one moment. ``eta_s`` is None until a step has been trained."""

    elapsed_s: float
    eta_s: float | None


class PaceMeter:
    """Measures the pace of the current attempt from the step it started (resumed) at."""

    def __init__(self) -> None:
        self._attempt: int | None = None
        self._first_step: int | None = None
        self._start_at = self._first_step_at = 0.0

    def measure(self, attempt: int, progress: Progress, now: float) -> Pace:
        if attempt != self._attempt:
            self._attempt, self._start_at, self._first_step = attempt, now, None
        if self._first_step is None and progress.stage not in ("starting", "setup", "load"):
            # The rate counts from the first training tick, not from the model load.
            self._first_step, self._first_step_at = progress.step, now
        elapsed = now - self._start_at
        if self._first_step is None or progress.step <= self._first_step:
            return Pace(elapsed, None)
        rate = (progress.step - self._first_step) / max(1e-9, now - self._first_step_at)
        left = (progress.max_steps or 0) - progress.step
        return Pace(elapsed, left / rate if progress.max_steps and left >= 0 else None)


class ConsoleStream(io.TextIOBase):
    """``stream`` for as long as it takes writes; then nothing. A closed pipe or terminal (``run | tee``
    ended by Ctrl-C) costs the console, not the run: the first failure turns the console off, points
    the fd at ``/dev/null`` (for the interpreter's flush at exit) and is logged once as ``output_failed``."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self._stream, self._reported = stream, False
        self.lost: str | None = None  # why the console went away (None: it is there)

    def write(self, text: str) -> int:
        self._try(self._stream.write, text)
        self.flush()
        return len(text)

    def flush(self) -> None:
        self._try(self._stream.flush)

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

    def _try(self, action: Callable[..., object], *args: str) -> None:  # the first failure loses the console
        if self.lost is not None:
            return
        try:
            action(*args)
        except (OSError, ValueError) as error:  # EPIPE, EIO; ValueError: a closed file
            self.lost = f"{type(error).__name__}: {error}"
            with contextlib.suppress(OSError, ValueError, io.UnsupportedOperation, AttributeError):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, self._stream.fileno())
                os.close(null)


class ConsoleLost(OSError):
    """The console stopped taking writes (its reader or terminal went away)."""


def best_effort(stream: TextIO) -> tuple[TextIO, ConsoleStream]:
    """``stream`` as a :class:`ConsoleStream`, typed ``TextIO`` for its writers (it has write, flush, isatty,
    fileno), and as itself."""
    console = stream if isinstance(stream, ConsoleStream) else ConsoleStream(stream)
    return cast(TextIO, console), console
