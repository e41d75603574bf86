"""Host memory sampling through psutil."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import psutil
import pytest

from qlora_supervise.supervisor.watching.host import HostSample, sample_host, tree_rss


def test_own_process_has_rss() -> None:
    """A sample of this test's own pid shows resident memory and sane host totals."""
    sample = sample_host(os.getpid())
    assert isinstance(sample, HostSample)
    assert sample.child_rss_bytes > 0
    assert 0 < sample.available <= sample.total
    assert sample.swap_used >= 0 and sample.time > 0


def test_no_pid_means_zero_rss() -> None:
    """Between attempts (no child) the host is still sampled, with rss 0."""
    assert sample_host(None).child_rss_bytes == 0


def test_vanished_process_counts_zero() -> None:
    """A pid whose process has exited and been reaped gives rss 0 rather than an exception."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert sample_host(child.pid).child_rss_bytes == 0


@pytest.fixture
def parent_with_child() -> Iterator[tuple[psutil.Process, psutil.Process]]:
    """A python process that started a sleeping python child."""
    script = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time; time.sleep(60)'])"
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.monotonic() + 20
        while not (kids := psutil.Process(parent.pid).children()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert kids, "the child did not start"
        yield psutil.Process(parent.pid), kids[0]
    finally:
        for kid in psutil.Process(parent.pid).children(recursive=True):
            kid.kill()
        parent.kill()
        parent.wait()


def test_rss_sums_the_process_tree(parent_with_child: tuple[psutil.Process, psutil.Process]) -> None:
    """The rss of a parent's tree includes its child's."""
    parent, child = parent_with_child
    assert tree_rss(parent.pid) > tree_rss(child.pid) > 0
