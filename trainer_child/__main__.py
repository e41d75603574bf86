"""``python -m qlora_supervise.trainer_child --spec attempt.json``: one training attempt.

Order matters here: the environment (hub offline, visible device, allocator settings, malloc
arenas) is fixed *before* anything imports torch, because the CUDA allocator reads its
settings once, when CUDA initialises.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from qlora_supervise.trainer_child.contract.codes import ExitCode
from qlora_supervise.trainer_child.contract.devices import DeviceError, bind_device
from qlora_supervise.trainer_child.contract.processes import leave
from qlora_supervise.trainer_child.contract.spec import AttemptSpec
from qlora_supervise.trainer_child.run.torchrun import SINGLE, RankPlace, rank_spec, this_rank, world_mismatch


def read_spec(path: Path) -> AttemptSpec:
    return AttemptSpec.from_json(path.read_text(encoding="utf-8"))


def prepare_env(spec: AttemptSpec, place: RankPlace = SINGLE) -> None:
    """Offline hub, one visible device, allocator settings: all before ``import torch``.

    The device goes through ``contract.devices.bind_device``, the function the supervisor's GPU monitor
    calls with the same inherited ``CUDA_VISIBLE_DEVICES``, so the GPU trained on is the GPU
    watched. Raises DeviceError when the device names no visible GPU. Under torchrun every rank
    keeps the GPUs it inherited and trains on ``cuda:LOCAL_RANK`` (``gpu: cpu`` still hides them).
    """
    prepare_env_for(spec.device, spec.knobs.expandable_segments, place)


def prepare_env_for(device_name: str, expandable_segments: bool, place: RankPlace = SINGLE) -> None:
    """:func:`prepare_env` from the two facts of the spec it reads (a warm spare has no spec yet)."""
    from qlora_supervise.trainer_child.run.memory import prepare_process_env

    os.environ["HF_HUB_OFFLINE"] = "1"  # never download: the lab server may have no network
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if not place.distributed:
        binding = bind_device(device_name, os.environ.get("CUDA_VISIBLE_DEVICES"))
        os.environ["CUDA_VISIBLE_DEVICES"] = binding.child_visible_devices
    elif device_name.strip() == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    prepare_process_env(expandable_segments)


def parse_args(argv: list[str] | None, prog: str) -> Path:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--spec", type=Path, required=True, help="attempt spec (JSON: AttemptSpec)")
    spec: Path = parser.parse_args(argv).spec
    return spec


def main(argv: list[str] | None = None) -> int:
    path = parse_args(argv, "python -m qlora_supervise.trainer_child")
    try:
        spec = read_spec(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        # No spec, no error_file to write to: stderr and the config exit code are all we have.
        print(f"cannot read attempt spec {path}: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG)
    place = this_rank()
    mismatch = world_mismatch(spec, place)
    if mismatch is not None:
        print(f"trainer child: {mismatch}", file=sys.stderr)
        return int(ExitCode.CONFIG)
    spec = rank_spec(spec, place)  # this rank's own events and error files
    try:
        prepare_env(spec, place)
    except DeviceError as exc:  # before the event log exists: stderr and the config exit code
        print(f"trainer child: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG)
    from qlora_supervise.trainer_child.run.attempt import run

    return run(spec)


if __name__ == "__main__":
    leave(main())
