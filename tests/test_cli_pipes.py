"""A command whose reader goes away (``classify FILE | head``) ends quietly, without a traceback.

Issue 21 item 18.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from qlora_supervise.supervisor.commands.cli import BROKEN_PIPE_EXIT

OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total "
    "capacity of 23.68 GiB of which 1.06 GiB is free. Of the allocated memory 20.1 GiB is allocated "
    "by PyTorch, and 1.2 GiB is reserved by PyTorch but unallocated.\n"
)


def test_classify_into_a_closed_pipe_exits_quietly(tmp_path: Path) -> None:
    """Writing into a pipe whose reader has exited: no BrokenPipeError traceback, exit 141 as for SIGPIPE."""
    log = tmp_path / "child.log"
    log.write_text(OOM)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first byte (head -1, at its earliest)
    try:
        done = subprocess.run(
            [sys.executable, "-m", "qlora_supervise.supervisor.commands.cli", "classify", str(log)],
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,  # generous: one interpreter start on a loaded machine
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.returncode == BROKEN_PIPE_EXIT, done.stderr
    assert "Traceback" not in done.stderr and "BrokenPipeError" not in done.stderr, done.stderr


def test_classify_into_head_prints_the_first_line(tmp_path: Path) -> None:
    """`classify FILE | head -1` shows the kind line and nothing on stderr."""
    log = tmp_path / "child.log"
    log.write_text(OOM)
    command = f"{sys.executable} -m qlora_supervise.supervisor.commands.cli classify {log} | head -1"
    done = subprocess.run(["sh", "-c", command], capture_output=True, text=True, timeout=120, check=False)
    assert done.stdout.startswith("kind") and done.stderr == "", done.stderr
