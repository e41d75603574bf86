"""A full disk or a read-only run directory: free what is ours, wait for room, say how much; no traceback.

Issue 11 item 5, on a real small tmpfs (real ENOSPC / EROFS) with the real supervisor and the
scripted child, which checks for room before each save as the real trainer does.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from qlora_supervise.supervisor.record.eventlog import read_events
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.trainer_child.contract.disk_space import NoRoomForCheckpoint, ensure_room, is_disk_full

sys.path.insert(0, str(Path(__file__).parent))
from test_loop import _job, _wait_for

RUNNER = Path(__file__).with_name("run_scripted.py")
MIB = 1 << 20


# The supervisor's waits on a full disk are tested on the fake clock (test_loop_waits.py); these
# are their real-ENOSPC twins (a real tmpfs, the real supervisor, seconds each), in the slow tier.
pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs, mounted for the test (root only) and unmounted after it."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def _disk_job(tmp_path: Path, disk: Path, plan: dict[str, str], **supervise: Any) -> Path:
    job = _job(tmp_path, plan, **supervise)
    raw = yaml.safe_load(job.read_text())
    raw["output_dir"] = str(disk / "run")
    raw["train"]["save_steps"] = 2
    job.write_text(yaml.safe_dump(raw))
    return job


def _spawn(job: Path, ckpt_bytes: int) -> subprocess.Popen[str]:
    env = {**os.environ, "SCRIPTED_CHILD_CKPT_BYTES": str(ckpt_bytes)}
    return subprocess.Popen(
        [sys.executable, str(RUNNER), str(job)], stderr=subprocess.PIPE, text=True, env=env
    )


def _saw(run: Path, name: str) -> bool:
    return any(e["event"] == name for e in read_events(run / "events.jsonl"))


def test_a_full_disk_waits_for_room_then_finishes(tmp_path: Path, small_disk: Path) -> None:
    """A checkpoint that will not fit fails as disk_full; the supervisor waits for room; the run ends 0."""
    filler = small_disk / "filler.bin"
    filler.write_bytes(b"\0" * (5 * MIB))
    job = _disk_job(tmp_path, small_disk, {"default": "ok"}, disk_wait="60s")
    proc = _spawn(job, ckpt_bytes=MIB)
    run = small_disk / "run"
    _wait_for(lambda: _saw(run, "waiting_for_disk"), timeout=60)
    waiting = next(e for e in read_events(run / "events.jsonl") if e["event"] == "waiting_for_disk")
    assert waiting["needed_bytes"] >= MIB and waiting["free_bytes"] < waiting["needed_bytes"]
    assert "the size of the last checkpoint" in waiting["words"] and str(run) in waiting["words"]
    filler.unlink()  # the operator frees space
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    records, _ = read_attempts(run / "attempts.jsonl")
    full = [r for r in records if r.failure and r.failure.kind == "disk_full"]
    assert full and full[0].decision is not None and full[0].decision.rung == "wait_for_disk"
    assert full[0].decision.waited_s > 0
    assert records[-1].outcome == "succeeded" and records[-1].steps_completed == 10


def test_a_disk_that_stays_full_gives_up_in_words_with_exit_3(tmp_path: Path, small_disk: Path) -> None:
    """When no room comes back within disk_wait the run gives up (exit 3), saying where and how much."""
    (small_disk / "filler.bin").write_bytes(b"\0" * (5 * MIB))
    job = _disk_job(tmp_path, small_disk, {"default": "ok"}, disk_wait="1s")
    proc = _spawn(job, ckpt_bytes=MIB)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 3, stderr
    assert "Traceback" not in stderr
    gave_up = next(e for e in read_events(small_disk / "run" / "events.jsonl") if e["event"] == "gave_up")
    assert "supervise.disk_wait" in gave_up["why"]


def test_a_disk_filled_to_the_last_byte_mid_run_stops_no_supervisor_write(
    tmp_path: Path, small_disk: Path
) -> None:
    """The disk filled completely mid-attempt: every write gets ENOSPC; it waits, then finishes."""
    job = _disk_job(tmp_path, small_disk, {"1": "slow"}, disk_wait="120s")
    proc = _spawn(job, ckpt_bytes=0)
    run = small_disk / "run"
    events = run / "attempt-001" / "child-events.jsonl"
    _wait_for(lambda: events.exists() and events.read_text().count('"heartbeat"') >= 3, timeout=60)
    filler = small_disk / "filler.bin"
    with filler.open("wb") as handle:  # every last block, as a runaway log would
        try:
            while True:
                handle.write(b"\0" * 65536)
                handle.flush()
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    time.sleep(4)
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""  # waiting, not crashed
    filler.unlink()
    _, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert _saw(run, "supervisor_disk_full") or _saw(run, "waiting_for_disk")
    records, _ = read_attempts(run / "attempts.jsonl")
    assert records[-1].outcome == "succeeded" and records[-1].steps_completed == 10


def test_the_supervisors_own_journal_write_on_a_full_disk_waits_and_goes_on(
    tmp_path: Path, small_disk: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk is full when the supervisor journals a finished attempt: it waits for room, then ends 0."""
    filler = small_disk / "filler.bin"
    job = _disk_job(tmp_path, small_disk, {"1": "fill_disk"}, disk_wait="120s")
    monkeypatch.setenv("SCRIPTED_CHILD_FILL", str(filler))  # the child inherits it; undone after the test
    proc = _spawn(job, ckpt_bytes=0)
    _wait_for(lambda: filler.exists() and filler.stat().st_size > 4 * MIB, timeout=60)
    time.sleep(3)
    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""  # waiting, not crashed
    filler.unlink()
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    run = small_disk / "run"
    full = next(e for e in read_events(run / "events.jsonl") if e["event"] == "supervisor_disk_full")
    assert "No space left on device" in full["error"] and "free" in full["words"]
    records, _ = read_attempts(run / "attempts.jsonl")
    assert [r.outcome for r in records] == ["succeeded"]


def test_a_read_only_child_save_is_disk_full_not_other(tmp_path: Path) -> None:
    """Injected fault (scripted child `erofs@N`): EROFS in a save is classified disk_full and waited out."""
    job = _job(tmp_path, {"1": "erofs@3"}, disk_wait="30s")
    proc = subprocess.run([sys.executable, str(RUNNER), str(job)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    records, _ = read_attempts(tmp_path / "run" / "attempts.jsonl")
    assert records[0].failure is not None and records[0].failure.kind == "disk_full"
    assert records[0].decision is not None and records[0].decision.rung == "wait_for_disk"


def test_a_disk_full_before_the_first_write_is_a_sentence_not_a_traceback(
    tmp_path: Path, small_disk: Path
) -> None:
    """A run directory on a disk filled to the last block before run starts: exit 2 naming the fix."""
    job = _disk_job(tmp_path, small_disk, {"default": "ok"})
    with (small_disk / "filler.bin").open("wb") as handle, contextlib.suppress(OSError):
        while True:
            handle.write(b"\0" * 65536)
            handle.flush()
    with contextlib.suppress(OSError):
        for n in range(10_000):  # the last inodes and blocks too
            (small_disk / f"f{n}").touch()
    proc = _spawn(job, ckpt_bytes=0)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 2, stderr
    assert "Traceback" not in stderr and "free space there" in stderr


def test_sigterm_while_waiting_for_room_stops_resumably(tmp_path: Path, small_disk: Path) -> None:
    """A stop signal during the wait for room exits 143, and the same command finishes once there is room."""
    filler = small_disk / "filler.bin"
    filler.write_bytes(b"\0" * (5 * MIB))
    job = _disk_job(tmp_path, small_disk, {"default": "ok"}, disk_wait="10m")
    proc = _spawn(job, ckpt_bytes=MIB)
    _wait_for(lambda: _saw(small_disk / "run", "waiting_for_disk"), timeout=60)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 143, stderr
    filler.unlink()
    again = _spawn(job, ckpt_bytes=MIB)
    _, stderr = again.communicate(timeout=60)
    assert again.returncode == 0, stderr


def test_the_room_check_before_a_save_raises_enospc_with_the_numbers(small_disk: Path) -> None:
    """Before a save, the child's check refuses when the last checkpoint would not fit, as a real ENOSPC."""
    checkpoints = small_disk / "checkpoints"
    last = checkpoints / "checkpoint-2"
    last.mkdir(parents=True)
    (last / "optimizer.pt").write_bytes(b"\0" * (3 * MIB))
    (last / "qlora_supervise_complete.json").write_text("{}")
    ensure_room(checkpoints)  # 5 MiB free: room for one more
    (small_disk / "filler.bin").write_bytes(b"\0" * (3 * MIB))
    with pytest.raises(NoRoomForCheckpoint) as caught:
        ensure_room(checkpoints)
    assert caught.value.errno == errno.ENOSPC and is_disk_full(caught.value)
    assert "the size of the last one" in str(caught.value)
    with pytest.raises(OSError) as real:
        (small_disk / "more.bin").write_bytes(b"\0" * (4 * MIB))
    assert is_disk_full(real.value)  # the kernel's own ENOSPC reads the same
