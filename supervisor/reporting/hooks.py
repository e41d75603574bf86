"""``supervise.on_event``: a lab's own command, run on ``retry``, ``gave_up`` and ``run_succeeded``.

The command is an argv list, run without a shell, with the event (the same JSON object as its
``events.jsonl`` line) on stdin and ``QLORA_SUPERVISE_EVENT=<name>`` in its environment, for
mail, a chat webhook or a pager. It runs to completion or its timeout
(``supervise.on_event_timeout``) before the loop goes on, so its order with the run's own
actions is fixed. A hook that fails, times out or cannot be started is logged
(``hook_failed``, a warning, through :class:`~.outputs.BestEffort`: once, then rate-limited) and
never stops or changes the run.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence

from structlog.typing import FilteringBoundLogger

from qlora_supervise.supervisor.record.events import Event
from qlora_supervise.supervisor.reporting.outputs import ON_EVENT, BestEffort

HOOKED_EVENTS = frozenset({Event.RETRY.value, Event.GAVE_UP.value, Event.RUN_SUCCEEDED.value})
ENV_EVENT = "QLORA_SUPERVISE_EVENT"


class EventHook:
    """Runs ``argv`` for each hooked event; its failures go to ``outputs`` (the run's, or its own).

    ``log`` is bound after the event log exists (it is ``outputs.log``).
    """

    def __init__(self, argv: Sequence[str], timeout_s: float, outputs: BestEffort | None = None) -> None:
        self.argv = list(argv)
        self.timeout_s = timeout_s
        self.outputs = outputs or BestEffort()

    @property
    def log(self) -> FilteringBoundLogger | None:
        return self.outputs.log

    @log.setter
    def log(self, log: FilteringBoundLogger | None) -> None:
        self.outputs.log = log

    def on_event(self, event: Mapping[str, object]) -> bool:
        """Run the hook for a hooked event; True when it ran and exited 0 (a failure is logged here)."""
        name = str(event.get("event"))
        if name not in HOOKED_EVENTS:
            return False
        problem = self._run(name, json.dumps(dict(event), default=str))
        if problem is None:
            self.outputs.worked(ON_EVENT)
            return True
        self.outputs.failed(ON_EVENT, problem, Event.HOOK_FAILED, hook=self.argv, for_event=name)
        return False

    def _run(self, name: str, payload: str) -> str | None:
        """None when the hook exited 0, else what went wrong, in one line."""
        try:
            done = subprocess.run(
                self.argv,
                input=payload,
                text=True,
                capture_output=True,
                timeout=self.timeout_s,
                env={**os.environ, ENV_EVENT: name},
                check=False,
            )
        except subprocess.TimeoutExpired:
            return f"timed out after {self.timeout_s:g}s (killed)"
        except OSError as error:
            return f"could not start: {error}"
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or [""]
            return f"exit status {done.returncode}: {tail[0][:300]}"
        return None
