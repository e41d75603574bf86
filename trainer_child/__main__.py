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

from .protocol import AttemptSpec, ExitCode


def read_spec(path: Path) -> AttemptSpec:
    return AttemptSpec.from_json(path.read_text(encoding="utf-8"))


def prepare_env(spec: AttemptSpec) -> None:
    """Offline hub, one visible device, allocator settings: all before ``import torch``."""
    from .memory import prepare_process_env

    os.environ["HF_HUB_OFFLINE"] = "1"  # never download: the lab server may have no network
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if spec.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif spec.device.startswith("cuda:"):
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.device.split(":", 1)[1]
    elif spec.device.startswith(("GPU-", "MIG-")):
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.device
    prepare_process_env(spec.knobs.expandable_segments)


def parse_args(argv: list[str] | None, prog: str) -> Path:
    parser = argparse.ArgumentParser(prog=prog)
    parser.add_argument("--spec", type=Path, required=True, help="attempt spec (JSON, protocol.AttemptSpec)")
    return parser.parse_args(argv).spec


def main(argv: list[str] | None = None) -> int:
    path = parse_args(argv, "python -m qlora_supervise.trainer_child")
    try:
        spec = read_spec(path)
    except (OSError, ValueError, TypeError, KeyError) as exc:
        # No spec, no error_file to write to: stderr and the config exit code are all we have.
        print(f"cannot read attempt spec {path}: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG)
    prepare_env(spec)
    from .attempt import run

    return run(spec)


if __name__ == "__main__":
    sys.exit(main())
