"""Questions about other processes, asked the same way by the supervisor and the child.

Standard library only.
"""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
