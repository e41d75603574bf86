"""``python -m qlora_supervise.trainer_child --spec attempt.json``: one training attempt. The environment (hub
offline, visible device, allocator settings, malloc arenas) is fixed *before* anything imports torch: the CUDA
allocator reads its settings once, when CUDA initialises."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from qlora_supervise.trainer_child.contract.codes import ExitCode
from qlora_supervise.trainer_child.contract.processes import leave
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DeviceError, bind_device
from qlora_supervise.trainer_child.run.torchrun import SINGLE, RankPlace, rank_spec, this_rank, world_mismatch


def read_spec(path: Path) -> AttemptSpec:
    return AttemptSpec.from_json(path.read_text(encoding="utf-8"))


def spec_or_none(path: Path) -> AttemptSpec | None:
    """The spec at ``path``, or None after saying on stderr why not (there is no error file yet)."""
    try:
        return read_spec(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        print(f"cannot read attempt spec {path}: {exc}", file=sys.stderr)
        return None


def prepare_env(spec: AttemptSpec, place: RankPlace = SINGLE) -> None:
    """Offline hub, one visible device, allocator settings: all before ``import torch``."""
    prepare_env_for(spec.device, spec.knobs.expandable_segments, place)


def prepare_env_for(device_name: str, expandable_segments: bool, place: RankPlace = SINGLE) -> None:
    """:func:`prepare_env` from the two facts it reads (a warm spare has no spec yet). The device goes
    through ``bind_device``, as in the supervisor's GPU monitor: the GPU trained on is the GPU watched
    (DeviceError when it names no visible GPU). Under torchrun every rank keeps the GPUs it inherited."""
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
    parser.add_argument("--spec", required=True, help="attempt spec (JSON: AttemptSpec)")
    return Path(parser.parse_args(argv).spec)


def main(argv: list[str] | None = None) -> int:
    if (spec := spec_or_none(parse_args(argv, "python -m qlora_supervise.trainer_child"))) is None:
        return int(ExitCode.CONFIG)
    place = this_rank()
    if (mismatch := world_mismatch(spec, place)) is not None:
        print(f"trainer child: {mismatch}", file=sys.stderr)
        return int(ExitCode.CONFIG)
    spec = rank_spec(spec, place)  # this rank's own events and error files
    try:
        prepare_env(spec, place)
    except DeviceError as exc:  # before the event log exists
        print(f"trainer child: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG)
    from qlora_supervise.trainer_child.run.attempt import run

    return run(spec)


if __name__ == "__main__":
    leave(main())
