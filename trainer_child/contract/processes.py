"""Processes, asked about the same way by the supervisor and the child, and the child's exit; the
child's ``python -m`` entry points, named once: the supervisor starts them by these names and never
imports them (they import torch)."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import NoReturn

from qlora_supervise.trainer_child.contract.codes import ExitCode

_PACKAGE = "qlora_supervise.trainer_child"
#: One attempt: ``python -m ATTEMPT --spec attempt-NNN/spec.json`` (trainer_child/__main__.py).
ATTEMPT = _PACKAGE
#: A warm spare that waits on stdin for the next attempt's spec.
SPARE = f"{_PACKAGE}.run.spare"
#: The adapter merged into the base model, in its own process.
MERGE = f"{_PACKAGE}.merge.process"
#: The tiny Llama-shaped model, tokenizer and dataset for the demo and the tests.
TINY = f"{_PACKAGE}.recipe.tiny"
#: Prints the data segment after the training stack's imports; with :data:`STACK_BYTES` only bytes.
STACK = f"{_PACKAGE}.recipe.stack"
STACK_BYTES = "--bytes"


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists and has not exited (it may belong to another user); a
    zombie has exited: an orphan's new parent (PID 1 in a container) may reap it late or never."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    try:  # the state follows the command name, which may hold spaces and parentheses
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return True  # no /proc to ask: kill(0) is the answer
    return state != "Z"


#: Exit statuses of a failed attempt: what the supervisor waits on before the next one starts.
FAILED_EXITS = frozenset(ExitCode) - {ExitCode.OK, ExitCode.STOPPED}


def leave(code: int) -> NoReturn:
    """End the child with ``code``; a failed attempt skips the teardown the next attempt would wait
    for (torch's took seconds on an H200; all that matters is on disk)."""
    if code in FAILED_EXITS:
        exit_now(code)
    sys.exit(code)


def exit_now(code: int) -> NoReturn:
    """``os._exit(code)`` after flushing stdout and stderr."""
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a full disk under child.log
            stream.flush()
    os._exit(code)
