"""What the real-process tests measure about this machine instead of assuming it.

* **The import baseline**: the trainer's data segment after the training stack's imports
  (``python -m qlora_supervise.trainer_child.recipe.stack --bytes``), about 0.37 GiB with the CPU
  build of torch and about 2.3 GiB with a CUDA build. A data-segment cap (``RLIMIT_DATA``) is the
  baseline plus what the tiny model's training needs, never a fixed number, or a CUDA build of
  torch fails the tests with ``MemoryCapError`` before the first step.
* **Timeouts**: a nominal wall time (set on the 2-core development machine) times this machine's
  measured slowdown against that one, times a generous factor of 3. They bound a stuck child;
  a slow machine or a loaded one (the whole suite, other users) must not trip them.

Both are measured once per test session, on first use only (the fast tier never pays for them).
"""

from __future__ import annotations

import functools
import subprocess
import sys
import time

from qlora_supervise.trainer_child.contract import processes

MIB = 1 << 20
#: Seconds :func:`_spin` takes on the development machine the nominal timeouts were set on
#: (2 cores; measured 0.26-0.37 s there with the suite running).
REFERENCE_SPIN_S = 0.3
#: How much longer than nominal (scaled to this machine) a test waits before calling it stuck.
GENEROUS = 3.0


@functools.cache
def import_baseline(python: str = sys.executable) -> int:
    """The trainer child's data segment, in bytes, after its imports with the torch installed here
    (or with ``python``'s: a foreign tool's venv, its own torch, transformers, peft, trl, ...)."""
    command = [python, "-m", processes.STACK, processes.STACK_BYTES]
    out = subprocess.run(command, capture_output=True, text=True, check=True, timeout=scaled(120))
    return int(out.stdout.split()[-1])


def above_baseline(headroom: int) -> int:
    """A data-segment cap ``headroom`` bytes above :func:`import_baseline`."""
    return import_baseline() + headroom


def _spin() -> float:
    """Wall time of a fixed pure-Python loop: the machine's single-core speed, under its load now."""
    started = time.perf_counter()
    total = 0
    for i in range(1_000_000):
        total += i * i
    return time.perf_counter() - started


@functools.cache
def slowdown() -> float:
    """This machine against the reference one (1.0 or more: a faster machine keeps the nominal)."""
    return max(1.0, min(_spin() for _ in range(3)) / REFERENCE_SPIN_S)


def scaled(nominal_s: float) -> float:
    """A timeout for what takes up to ``nominal_s`` on the reference machine: scaled and generous."""
    return nominal_s * slowdown() * GENEROUS
