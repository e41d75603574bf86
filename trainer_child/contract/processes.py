"""Processes, asked about the same way by the supervisor and the child, and the child's exit."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn

from qlora_supervise.trainer_child.contract.codes import ExitCode


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


#: Exit statuses of a failed attempt: what the supervisor waits on before the next one starts.
FAILED_EXITS = frozenset(
    {ExitCode.OOM, ExitCode.CONFIG, ExitCode.FAILED, ExitCode.CHECKPOINT, ExitCode.DISK_FULL}
)


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
