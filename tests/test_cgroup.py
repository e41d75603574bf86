"""The cgroup OOM-kill counter: file parsing, locating our cgroup, and the override seam."""

from __future__ import annotations

from pathlib import Path

import pytest

from qlora_supervise.supervisor.watching.host import (
    ENV_MEMORY_EVENTS,
    memory_events_path,
    oom_kill_count,
    read_oom_kill,
)

V2_EVENTS = "low 0\nhigh 12\nmax 40\noom 3\noom_kill 2\noom_group_kill 0\n"
V1_OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill 5\n"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (V2_EVENTS, 2),
        (V1_OOM_CONTROL, 5),
        ("oom_group_kill 7\n", None),  # a different counter, not ours
        ("low 0\nhigh 0\n", None),  # kernel without the counter
        ("oom_kill many\n", None),
        ("", None),
    ],
)
def test_read_oom_kill(tmp_path: Path, text: str, expected: int | None) -> None:
    """The exact oom_kill line of memory.events or memory.oom_control is read; others are not."""
    path = tmp_path / "memory.events"
    path.write_text(text)
    assert read_oom_kill(path) == expected


def test_missing_file_is_none(tmp_path: Path) -> None:
    """A file that is not there gives None, not an exception."""
    assert read_oom_kill(tmp_path / "absent") is None
    assert oom_kill_count(tmp_path / "absent") is None


def test_env_seam_names_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """QLORA_SUPERVISE_CGROUP_MEMORY_EVENTS replaces the cgroup lookup; an explicit path wins over it."""
    env_file, arg_file = tmp_path / "env.events", tmp_path / "arg.events"
    env_file.write_text("oom_kill 4\n")
    arg_file.write_text("oom_kill 9\n")
    monkeypatch.setenv(ENV_MEMORY_EVENTS, str(env_file))
    assert oom_kill_count() == 4
    assert oom_kill_count(arg_file) == 9
    env_file.write_text("oom_kill 5\n")  # read afresh each call: the loop compares before / after
    assert oom_kill_count() == 5


def _proc(tmp_path: Path, cgroup: str, mountinfo: str) -> tuple[Path, Path]:
    (tmp_path / "cgroup").write_text(cgroup)
    (tmp_path / "mountinfo").write_text(mountinfo)
    return tmp_path / "cgroup", tmp_path / "mountinfo"


def test_finds_v2_memory_events_of_our_cgroup(tmp_path: Path) -> None:
    """On a unified hierarchy the file is <cgroup2 mount>/<our path>/memory.events."""
    mount = tmp_path / "sys" / "fs" / "cgroup"
    ours = mount / "system.slice" / "qlora-supervise@job.service"
    ours.mkdir(parents=True)
    (ours / "memory.events").write_text(V2_EVENTS)
    (mount / "system.slice" / "memory.events").write_text("oom_kill 99\n")
    cgroup, mountinfo = _proc(
        tmp_path,
        "0::/system.slice/qlora-supervise@job.service\n",
        f"35 24 0:30 / {mount} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n",
    )
    assert memory_events_path(cgroup, mountinfo) == ours / "memory.events"


def test_finds_v1_oom_control_in_a_container(tmp_path: Path) -> None:
    """On cgroup v1 the memory controller's mount is used, with the mount's root taken off our path."""
    mount = tmp_path / "memory"
    ours = mount / "job"
    ours.mkdir(parents=True)
    (ours / "memory.oom_control").write_text(V1_OOM_CONTROL)
    cgroup, mountinfo = _proc(
        tmp_path,
        "12:pids:/docker/abc\n4:memory:/docker/abc/job\n1:name=systemd:/docker/abc\n0::/\n",
        (
            f"30 23 0:28 / {tmp_path}/tmpfs rw - tmpfs tmpfs rw\n"
            f"35 31 0:32 /docker/abc {mount} rw,relatime - cgroup cgroup rw,memory\n"
            f"36 31 0:33 /docker/abc {tmp_path}/cpu rw,relatime - cgroup cgroup rw,cpu,cpuacct\n"
        ),
    )
    assert memory_events_path(cgroup, mountinfo) == ours / "memory.oom_control"


def test_falls_back_to_the_nearest_visible_ancestor(tmp_path: Path) -> None:
    """When our own directory is not visible, the nearest ancestor's counter under the mount is used."""
    mount = tmp_path / "cg"
    mount.mkdir()
    (mount / "memory.events").write_text(V2_EVENTS)
    cgroup, mountinfo = _proc(
        tmp_path, "0::/hidden/deeper\n", f"35 24 0:30 / {mount} rw - cgroup2 cgroup2 rw\n"
    )
    assert memory_events_path(cgroup, mountinfo) == mount / "memory.events"


def test_no_memory_controller_is_none(tmp_path: Path) -> None:
    """Without a v2 memory.events or a v1 memory mount there is no counter."""
    cgroup, mountinfo = _proc(
        tmp_path, "0::/x\n", f"35 24 0:30 / {tmp_path}/nothing rw - cgroup2 cgroup2 rw\n"
    )
    assert memory_events_path(cgroup, mountinfo) is None
    assert memory_events_path(tmp_path / "absent", mountinfo) is None


def test_real_lookup_reads_this_processs_own_counter(monkeypatch: pytest.MonkeyPatch) -> None:
    """On this machine the lookup finds our cgroup's counter file (v2 or v1) and reads its oom_kill line."""
    monkeypatch.delenv(ENV_MEMORY_EVENTS, raising=False)
    path = memory_events_path()
    count = oom_kill_count()
    if path is None:  # no memory controller visible (some sandboxes): then no count either
        assert count is None
        return
    assert path.name in ("memory.events", "memory.oom_control") and path.is_file()
    # Read independently of read_oom_kill: the exact "oom_kill N" line (v2 also has oom_group_kill).
    lines = [line.split() for line in path.read_text().splitlines()]
    expected = next((int(v) for k, v in lines if k == "oom_kill"), None)
    assert count == expected
