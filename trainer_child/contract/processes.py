"""Questions about other processes, asked the same way by the supervisor and the child.

Standard library only.
"""

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
        return True
    return True


#: Exit statuses of a failed attempt: what the supervisor waits on before the next one starts.
FAILED_EXITS = frozenset(
    {ExitCode.OOM, ExitCode.CONFIG, ExitCode.FAILED, ExitCode.CHECKPOINT, ExitCode.DISK_FULL}
)


def leave(code: int) -> NoReturn:
    """End the child process with ``code``; a failed attempt skips the interpreter's teardown.

    Why: after a failure everything that matters is already on disk and fsynced (the error
    report, an emergency checkpoint, the event log closed), and the next attempt waits for this
    exit. Tearing down torch's modules and the CUDA caching allocator one object at a time took
    seconds on an H200; the kernel frees the process's memory and the driver its context at once.
    """
    if code in FAILED_EXITS:
        for stream in (sys.stdout, sys.stderr):
            # A full disk under child.log must not turn this exit into another one.
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)
    sys.exit(code)
