"""The commands people type: ``run``, ``status``, ``plan``, ``validate`` and the rest, and the CLI that
dispatches them."""

from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode


class BadInput(SupervisorExit):
    """Exit 2 (``BAD_JOB``) with ``message``: a bad job file, flag or run directory."""

    def __init__(self, message: str) -> None:
        super().__init__(SupervisorExitCode.BAD_JOB, message)
