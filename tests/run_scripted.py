"""Run the real supervisor with the scripted child (tests only): ``python run_scripted.py JOB``.

The supervisor is the real one, signal handlers included; only the child's command is the
scripted stand-in of ``scripted_child.py``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from qlora_supervise.supervisor.exit_codes import SupervisorExit
from qlora_supervise.supervisor.loop import Seams
from qlora_supervise.supervisor.run import run_job

CHILD = Path(__file__).with_name("scripted_child.py")


def scripted_seams() -> Seams:
    return Seams(
        argv=lambda spec, phase: [sys.executable, str(CHILD), "--spec", str(spec)],
        tick_s=0.05,
        sample_every_s=0.5,
        stop_grace_s=10.0,
    )


if __name__ == "__main__":
    try:
        sys.exit(run_job(sys.argv[1], plain=True, seams=scripted_seams()))
    except SupervisorExit as stop:
        print(stop.message, file=sys.stderr)
        sys.exit(int(stop.code))
