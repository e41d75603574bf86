"""Room on the disk for the run: after a ``disk_full`` the supervisor frees what killed writers of
this run left, then waits for as much room as the last checkpoint took (at least :data:`MIN_ROOM`)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.record.rundir import RunDir
from qlora_supervise.trainer_child.contract.checkpoints import TEMP_PREFIX, remove_stale_temps
from qlora_supervise.trainer_child.contract.disk_space import free_bytes, last_checkpoint_bytes, tree_bytes
from qlora_supervise.trainer_child.contract.processes import pid_alive

MIN_ROOM = 1 << 20  # a journal line, a state file, an error report and some events


def room_needed(rd: RunDir, reported: int | None = None) -> int:
    """Bytes to wait for: what the child said it needs, the last checkpoint's size, or the minimum."""
    return max(MIN_ROOM, reported or 0, last_checkpoint_bytes(rd.checkpoints) or 0)


def room_free(rd: RunDir) -> int:
    """Bytes the run may still write on its disk (0 on a read-only mount)."""
    return free_bytes(rd.checkpoints if rd.checkpoints.exists() else rd.root)


def free_ours(rd: RunDir) -> int:
    """Delete the staging directories, adapter temps and atomic writes' temp files that killed
    writers left (the caller holds the run's lock); returns the bytes freed."""
    freed = 0
    if rd.checkpoints.is_dir() and not rd.checkpoints.is_symlink():  # never sized or pruned through a link
        sizes = {
            path: tree_bytes(path) for path in rd.checkpoints.iterdir() if path.name.startswith(TEMP_PREFIX)
        }
        gone = remove_stale_temps(rd.checkpoints)
        freed += sum(sizes.get(path, 0) for path in gone)
    for path in _stale_entries(rd):
        size = tree_bytes(path) if path.is_dir() else path.stat().st_size
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        freed += size
    return freed


def _stale_entries(rd: RunDir) -> list[Path]:
    found: list[Path] = []
    for directory in [rd.root, *sorted(rd.root.glob("attempt-*"))]:
        if not directory.is_dir() or directory.is_symlink():
            continue
        for path in directory.iterdir():
            name = path.name
            if name.startswith(".") and name.endswith(".tmp") and path.is_file():
                found.append(path)  # write_text_atomic's temp file, left by a kill mid-write
            elif (
                name.startswith((".tmp-adapter-", ".old-adapter-", ".tmp-merged-", ".old-merged-"))
                and (tail := name.rsplit("-", 1)[-1]).isdigit()
                and not pid_alive(int(tail))
            ):
                found.append(path)
    return found


def room_words(rd: RunDir, needed: int, free: int) -> str:
    """The sentence for people: where, how much is free, how much is needed and why, what to do."""
    where = rd.checkpoints if rd.checkpoints.exists() else rd.root
    if free == 0 and not os.access(where, os.W_OK):
        return f"{where} is read-only: remount it writable (the run needs {format_bytes(needed)} there)"
    last = last_checkpoint_bytes(rd.checkpoints)
    basis = "the size of the last checkpoint" if last and needed <= last else "the journal, state and reports"
    return (
        f"the disk holding {where} has {format_bytes(free)} free; the run needs {format_bytes(needed)} "
        f"there ({basis}): free {format_bytes(max(0, needed - free))} or more"
    )
