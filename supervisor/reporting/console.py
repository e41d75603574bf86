"""Progress on the console: a tqdm bar on a terminal, one plain line per logging step otherwise.

The bar starts at the resume step, so its rate and ETA count only this attempt. Under journald, in a
pipe or with ``--plain``, a line at each multiple of ``logging_steps`` and at a stage change, with
times as tqdm prints them (``2:10:00``), never epoch seconds."""

from __future__ import annotations

from typing import NoReturn, TextIO

from tqdm import tqdm

from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.reporting.pace import Pace
from qlora_supervise.supervisor.watching.heartbeats import Progress

_TRAINING = frozenset({"forward", "backward", "optimizer"})


class ProgressDisplay:
    """Draws one attempt's progress; :meth:`clear` ends the bar before a log line."""

    def __init__(self, stream: TextIO, plain: bool, logging_steps: int = 1) -> None:
        self._stream = stream
        self._tty = stream.isatty() and not plain
        self._every = max(1, logging_steps)
        self._bar: tqdm[NoReturn] | None = None  # a bar with no iterable: fed by update()
        self._last_key: tuple[int, int, str] | None = None

    def update(self, attempt: int, progress: Progress, pace: Pace) -> None:
        key = (attempt, progress.step, progress.stage)
        if self._tty:
            self._draw(attempt, progress)
        elif key != self._last_key and self._worth_a_line(progress):
            print(plain_line(attempt, progress, pace), file=self._stream, flush=True)
        self._last_key = key

    def clear(self) -> None:
        """End the bar (its last state stays on screen) so the next log line starts clean."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _worth_a_line(self, p: Progress) -> bool:
        last = self._last_key
        if last is None:
            return True
        # forward -> backward -> optimizer every step is not news; load, save, eval and merge are.
        if last[2] != p.stage and not (p.stage in _TRAINING and last[2] in _TRAINING):
            return True
        return p.step != last[1] and (p.step % self._every == 0 or p.step == p.max_steps)

    def _draw(self, attempt: int, p: Progress) -> None:
        bar = self._bar
        if bar is None:
            bar = self._bar = tqdm(
                total=p.max_steps,
                initial=p.step,
                desc=f"attempt {attempt}",
                unit="step",
                file=self._stream,
                dynamic_ncols=True,
                leave=True,
            )
        bar.set_postfix_str(_postfix(p), refresh=False)
        if p.step > bar.n:
            bar.update(p.step - bar.n)  # redraws at tqdm's own rate limit
        else:
            bar.refresh()


def _postfix(p: Progress) -> str:
    parts = [p.stage]
    if p.loss is not None:
        parts.append(f"loss {p.loss:.4f}")
    if p.tokens_per_s is not None:
        parts.append(f"{p.tokens_per_s:.0f} tok/s")
    if p.peak_bytes:
        parts.append(f"peak {format_bytes(p.peak_bytes)}")
    return " | ".join(parts)


def plain_line(attempt: int, p: Progress, pace: Pace) -> str:
    """``attempt 2 | step 40/100 | forward | loss 1.2345 | 1893 tok/s | 03:10 elapsed, ETA 04:45``."""
    parts = [f"attempt {attempt}", f"step {p.step}/{p.max_steps or '?'}", _postfix(p)]
    timing = f"{tqdm.format_interval(pace.elapsed_s)} elapsed"
    if pace.eta_s is not None:
        timing += f", ETA {tqdm.format_interval(pace.eta_s)}"
    parts.append(timing)
    return " | ".join(parts)
