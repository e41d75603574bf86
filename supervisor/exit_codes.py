"""Exit codes of the ``qlora-supervise`` command, and the exception that carries one."""

from __future__ import annotations

import enum


class SupervisorExitCode(enum.IntEnum):
    FINISHED = 0
    BAD_JOB = 2  # bad job file or usage: fix the input and run again
    GAVE_UP = 3  # ladder exhausted, same failure with nothing left, or a crash loop
    NOT_RETRYABLE = 4  # a failure no config change can fix (config error, bad data, ...)
    GPU_FAULT = 5  # the GPU itself failed (a fatal NVML Xid: off the bus, uncorrectable ECC): not retried
    NOTHING_FITS = 6  # no config of the model or a fallback is predicted to fit the card: no child started
    STOPPED_SIGINT = 130  # stopped by SIGINT: run the same command again to resume
    STOPPED_SIGTERM = 143  # stopped by SIGTERM: run the same command again to resume


EXIT_CODES_HELP = """\
exit codes:
  0    finished: the adapter is in <output_dir>/adapter
  2    bad job file or usage (every problem is listed with its field path)
  3    gave up: ladder exhausted, same failure with nothing left to change, or no progress
  4    non-retryable failure (config error, missing model or data field, ...)
  5    GPU fault: a fatal Xid (fell off the bus, uncorrectable ECC, ...); not retried on that GPU
  6    nothing fits: no config of the model (or a fallback) is predicted to fit; no child started
  130  stopped by SIGINT, 143 stopped by SIGTERM: resumable, run the same command again"""


class SupervisorExit(Exception):
    """Raised to end a command with ``code``; ``message`` goes to stderr."""

    def __init__(self, code: SupervisorExitCode, message: str = "") -> None:
        super().__init__(message)
        self.code = code
        self.message = message
