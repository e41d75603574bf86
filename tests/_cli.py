"""``qlora-supervise ARGS`` run by ``main()`` in the test's own process, for tests about what a command
says and its exit status rather than about the process: a subprocess pays the import of the
supervisor (about half a second of CPU) on every call. The process boundary itself (the console
script, signals, pipes, memory bounds) stays covered by the tests that start the real command
(test_job's validate, test_cli_pipes, test_packaging, test_bounded_input, test_reliability_tools)."""

from __future__ import annotations

import io
import os
import subprocess
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, redirect_stderr, redirect_stdout

from qlora_supervise.supervisor.commands.cli import main


@contextmanager
def _kept_process_state(env: Mapping[str, str] | None) -> Iterator[None]:
    """The environment, umask and working folder a command may change are given back after it."""
    saved, cwd = dict(os.environ), os.getcwd()
    umask = os.umask(0o022)
    os.umask(umask)
    if env is not None:
        os.environ.clear()
        os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        os.umask(umask)
        os.chdir(cwd)


def cli(*args: str, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """What ``subprocess.run(["qlora-supervise", *args], capture_output=True, text=True)`` returns;
    an exception the command does not turn into an exit status fails the test (as a traceback would)."""
    out, err = io.StringIO(), io.StringIO()
    with _kept_process_state(env), redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(["qlora-supervise", *args], code, out.getvalue(), err.getvalue())
