"""Run the real supervisor with the scripted child (tests only): ``python run_scripted.py JOB``.

The supervisor is the real one, signal handlers included; only the child's command is the
scripted stand-in of ``scripted_child.py``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.exit_codes import SupervisorExit
from qlora_supervise.supervisor.loop.arbiter import Seams
from qlora_supervise.supervisor.watching.gpu import GpuSample

CHILD = Path(__file__).with_name("scripted_child.py")


class FakeGpu:
    """An NVML stand-in (a named seam): another process holds the card until ``frees_after`` polls."""

    def __init__(self, frees_after: int | None) -> None:
        self.polls = 0
        self.frees_after = frees_after

    def sample(self, pids: set[int]) -> GpuSample:
        if not pids:
            self.polls += 1  # the contention wait polls with no pids
        freed = self.frees_after is not None and self.polls >= self.frees_after
        free = 20 * 1024**3 if freed else 200 * 1024**2
        others = () if freed else ((4242, 18 * 1024**3),)
        total = 24 * 1024**3
        return GpuSample(time.time(), 0, total, total - free, free, 0, others)

    def close(self) -> None:
        pass


def scripted_seams() -> Seams:
    seams = Seams(
        argv=lambda spec, phase: [sys.executable, str(CHILD), "--spec", str(spec)],
        tick_s=0.05,
        sample_every_s=0.5,
        stop_grace_s=float(os.environ.get("SCRIPTED_STOP_GRACE_S", "10")),
    )
    if os.environ.get("SCRIPTED_GPU_NEVER_FREES"):
        gpu = FakeGpu(frees_after=None)
        seams.open_gpu = lambda device: gpu  # type: ignore[assignment,return-value]
    return seams


def cli_main(argv: list[str]) -> int:
    """``qlora-supervise ARGV`` as the installed command runs it (its exit codes, its handling of
    a closed stdout), with ``run``'s child the scripted one."""
    from qlora_supervise.supervisor.commands import cli
    from qlora_supervise.supervisor.commands import run as run_command

    real = run_command.run_job

    def scripted_run_job(*args: object, **kwargs: object) -> int:
        kwargs.setdefault("seams", scripted_seams())
        return real(*args, **kwargs)  # type: ignore[arg-type]

    run_command.run_job = scripted_run_job  # type: ignore[assignment]
    return cli.main(argv)


if __name__ == "__main__":
    if sys.argv[1] == "--cli":  # python run_scripted.py --cli run job.yaml --plain
        sys.exit(cli_main(sys.argv[2:]))
    try:
        sys.exit(run_job(sys.argv[1], plain=True, seams=scripted_seams()))
    except SupervisorExit as stop:
        print(stop.message, file=sys.stderr)
        sys.exit(int(stop.code))
