"""Checkpoints, the adapter and the merged model are never written, moved or deleted through a link,
and they are group-readable (0750 / 0640) whatever wrote them.

Issue 21 items 3, 8 and 10: the child's checkpoint writer, rotation, quarantine and final saves.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from qlora_supervise.trainer_child.contract import checkpoints
from qlora_supervise.trainer_child.contract.checkpoints import (
    CHECKPOINT_COMPLETE_MARKER,
    QUARANTINE_REASON,
    UnsafeCheckpointPath,
    complete_checkpoints,
    quarantine,
)
from qlora_supervise.trainer_child.contract.spec import Knobs


def _publish(root: Path, step: int) -> Path:
    staging = checkpoints.staging_dir(root, step) / f"checkpoint-{step}"
    staging.mkdir(parents=True)
    (staging / "adapter_model.safetensors").write_bytes(b"x" * 10)
    return checkpoints.publish(
        staging, root / f"checkpoint-{step}", step=step, knobs=Knobs(model="m"), emergency=False
    )


def _outside(tmp_path: Path, *, marked: bool) -> Path:
    """A directory outside the run that looks like a checkpoint (with or without the marker)."""
    victim = tmp_path / "outside" / "precious"
    victim.mkdir(parents=True)
    (victim / "data.bin").write_bytes(b"keep me")
    if marked:
        (victim / CHECKPOINT_COMPLETE_MARKER).write_text("{}")
    return victim


def test_a_linked_checkpoint_is_neither_counted_nor_rotated_away(tmp_path: Path) -> None:
    """A planted checkpoint-1 link to a marked directory elsewhere is no checkpoint; rotation spares it."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    victim = _outside(tmp_path, marked=True)
    (root / "checkpoint-1").symlink_to(victim)
    for step in (2, 4, 6):
        _publish(root, step)
    assert [step for step, _ in complete_checkpoints(root)] == [2, 4, 6]
    checkpoints.rotate(root, keep=1, protect=None)
    assert [step for step, _ in complete_checkpoints(root)] == [6]
    assert (victim / "data.bin").read_bytes() == b"keep me"
    assert (root / "checkpoint-1").is_symlink()


def test_an_unmarked_linked_checkpoint_is_not_quarantined_through(tmp_path: Path) -> None:
    """Rotation's quarantine of unmarked leftovers skips a link: no reason file lands in its target."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    victim = _outside(tmp_path, marked=False)
    (root / "checkpoint-3").symlink_to(victim)
    _publish(root, 4)
    checkpoints.rotate(root, keep=2, protect=None)
    assert sorted(p.name for p in victim.iterdir()) == ["data.bin"]
    assert not (tmp_path / "checkpoints-quarantine").exists()


def test_quarantine_refuses_a_link_and_a_linked_folder(tmp_path: Path) -> None:
    """quarantine() of a link, or into a quarantine folder that is a link, raises and writes nothing."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    victim = _outside(tmp_path, marked=False)
    (root / "checkpoint-3").symlink_to(victim)
    with pytest.raises(UnsafeCheckpointPath):
        quarantine(root / "checkpoint-3", "bad")
    real = _publish(root, 5)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "checkpoints-quarantine").symlink_to(elsewhere)
    with pytest.raises(UnsafeCheckpointPath, match="symbolic link"):
        quarantine(real, "bad")
    assert list(elsewhere.iterdir()) == [] and real.is_dir()
    assert not (victim / QUARANTINE_REASON).exists()


def test_a_linked_checkpoints_dir_is_refused_before_a_save(tmp_path: Path) -> None:
    """staging_dir (asked before every save) raises when checkpoints/ is a link; nothing is written there."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    root = tmp_path / "checkpoints"
    root.symlink_to(elsewhere)
    with pytest.raises(UnsafeCheckpointPath, match="symbolic link"):
        checkpoints.staging_dir(root, 2)
    assert complete_checkpoints(root) == [] and checkpoints.remove_stale_temps(root) == []
    assert list(elsewhere.iterdir()) == []


def test_a_link_in_the_way_of_a_save_is_removed_not_followed(tmp_path: Path) -> None:
    """publish() over a planted checkpoint-N link removes the link; its target keeps its bytes."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    victim = _outside(tmp_path, marked=False)
    (root / "checkpoint-2").symlink_to(victim)
    final = _publish(root, 2)
    assert final.is_dir() and not final.is_symlink()
    assert sorted(p.name for p in victim.iterdir()) == ["data.bin"]


def _temp_with_0600_safetensors(tmp_path: Path, name: str) -> Path:
    """A finished directory as safetensors leaves it: the tensor file 0600, a subfolder 0700."""
    # safetensors' numpy writer: the same file writer as torch's, without torch in the test process.
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    numpy = pytest.importorskip("numpy")
    temp = tmp_path / f".tmp-{name}-{os.getpid()}"
    (temp / "sub").mkdir(parents=True)
    os.chmod(temp / "sub", 0o700)
    safetensors_numpy.save_file(
        {"w": numpy.zeros(2, dtype=numpy.float32)}, str(temp / "adapter_model.safetensors")
    )
    (temp / "config.json").write_text("{}")
    os.chmod(temp / "config.json", 0o644)
    return temp


def _modes(root: Path) -> dict[str, int]:
    return {
        p.relative_to(root).as_posix(): stat.S_IMODE(os.lstat(p).st_mode) for p in [root, *root.rglob("*")]
    }


@pytest.mark.parametrize("name", ["adapter", "merged"])
def test_final_directories_are_group_readable_0750_and_0640(tmp_path: Path, name: str) -> None:
    """replace_dir (the adapter's and the merge's save) settles every directory 0750 and file 0640."""
    temp = _temp_with_0600_safetensors(tmp_path, name)
    assert stat.S_IMODE(os.stat(temp / "adapter_model.safetensors").st_mode) == 0o600  # what safetensors does
    final = tmp_path / name
    checkpoints.replace_dir(temp, final)
    assert _modes(final) == {
        ".": 0o750,
        "sub": 0o750,
        "adapter_model.safetensors": 0o640,
        "config.json": 0o640,
    }


def test_checkpoint_files_are_group_readable(tmp_path: Path) -> None:
    """publish() gives a checkpoint's files 0640 and its directories 0750, whatever safetensors left."""
    temp = _temp_with_0600_safetensors(tmp_path, "checkpoint-3")
    final = checkpoints.publish(
        temp, tmp_path / "checkpoint-3", step=3, knobs=Knobs(model="m"), emergency=False
    )
    assert set(_modes(final).values()) <= {0o750, 0o640}
    assert _modes(final)["adapter_model.safetensors"] == 0o640 and _modes(final)["."] == 0o750


def test_a_refused_adapter_link_leaves_nothing_behind(tmp_path: Path) -> None:
    """Saving over a planted adapter link removes the link: no .old-adapter-<pid>, the target untouched."""
    victim = _outside(tmp_path, marked=False)
    (tmp_path / "adapter").symlink_to(victim)
    temp = tmp_path / f".tmp-adapter-{os.getpid()}"
    temp.mkdir()
    (temp / "adapter_config.json").write_text("{}")
    checkpoints.replace_dir(temp, tmp_path / "adapter")
    assert (tmp_path / "adapter").is_dir() and not (tmp_path / "adapter").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "outside"]
    assert sorted(p.name for p in victim.iterdir()) == ["data.bin"]


def test_replacing_an_adapter_leaves_no_old_copy(tmp_path: Path) -> None:
    """An existing adapter is replaced whole, and its .old- copy is gone after the save."""
    (tmp_path / "adapter").mkdir()
    (tmp_path / "adapter" / "old.bin").write_bytes(b"o")
    temp = tmp_path / ".tmp-adapter-1"
    temp.mkdir()
    (temp / "new.bin").write_bytes(b"n")
    checkpoints.replace_dir(temp, tmp_path / "adapter")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter"]
    assert [p.name for p in (tmp_path / "adapter").iterdir()] == ["new.bin"]


class _Saves:
    """A model or tokenizer stand-in whose save_pretrained writes like safetensors (0600)."""

    def __init__(self, name: str) -> None:
        self.name = name

    def save_pretrained(self, directory: Path) -> None:
        Path(directory).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(directory) / self.name, os.O_WRONLY | os.O_CREAT, 0o600)
        os.write(fd, b"tensors")
        os.close(fd)


class _Trainer:
    model = _Saves("adapter_model.safetensors")


def test_the_childs_adapter_save_refuses_a_link_and_is_group_readable(tmp_path: Path) -> None:
    """save_adapter over a planted adapter link: a real 0750 directory of 0640 files, no .old- left."""
    from qlora_supervise.trainer_child.run.attempt import save_adapter

    victim = _outside(tmp_path, marked=False)
    (tmp_path / "adapter").symlink_to(victim)
    save_adapter(_Trainer(), _Saves("tokenizer.json"), tmp_path / "adapter")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "outside"]
    assert _modes(tmp_path / "adapter") == {
        ".": 0o750,
        "adapter_model.safetensors": 0o640,
        "tokenizer.json": 0o640,
    }
    assert sorted(p.name for p in victim.iterdir()) == ["data.bin"]


def test_the_child_refuses_a_linked_checkpoints_dir_as_a_config_error(tmp_path: Path) -> None:
    """chosen_checkpoint (every attempt's first look at checkpoints/) raises ConfigError for a link."""
    from qlora_supervise.trainer_child.run.attempt import chosen_checkpoint
    from qlora_supervise.trainer_child.run.failure import ConfigError

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (tmp_path / "checkpoints").symlink_to(elsewhere)

    class _Spec:
        checkpoints_dir = str(tmp_path / "checkpoints")
        resume_from = "auto"

    with pytest.raises(ConfigError, match="symbolic link"):
        chosen_checkpoint(_Spec())  # type: ignore[arg-type]
