"""A warm spare trainer: ``python -m qlora_supervise.trainer_child.run.spare --run-dir R --device D
[--expandable-segments] [--model M] [--prepare SPEC]``. It fixes the environment and imports the training
stack as an attempt does (``--prepare``: also loads the tokenizer and rows of the attempt it stands behind),
prints one ``spare_ready`` JSON line, and waits on stdin for ``{"spec": PATH, "log": PATH}``: it acknowledges
(``spare_ack``), sends its output to the attempt's log and runs the attempt. Empty stdin: exit 0. It touches
no CUDA while it waits; it refuses (ExitCode.CONFIG) a spec whose environment is not its own."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from qlora_supervise.trainer_child.contract.codes import ExitCode
from qlora_supervise.trainer_child.contract.processes import leave
from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DeviceError
from qlora_supervise.trainer_child.run.memory import proc_status_bytes

if TYPE_CHECKING:  # at run time it comes after the imports the environment must precede
    from qlora_supervise.trainer_child.recipe.data import Prepared


def warm_up(device_name: str, expandable_segments: bool, model: str | None) -> dict[str, object]:
    from qlora_supervise.trainer_child.__main__ import prepare_env_for
    from qlora_supervise.trainer_child.recipe.stack import import_training_classes, import_training_stack

    started = time.monotonic()
    prepare_env_for(device_name, expandable_segments)
    import torch

    import_training_stack()
    import_training_classes(model)
    return {
        "event": "spare_ready",
        "pid": os.getpid(),
        "import_s": round(time.monotonic() - started, 2),
        "cuda_initialized": bool(torch.cuda.is_initialized()),  # type: ignore[no-untyped-call]
    }


def prepare_ahead(spec_path: str | None) -> tuple[Prepared | None, dict[str, object]]:
    """The tokenizer and rows of the spec at ``spec_path``, and what it cost. A spare that cannot
    prepare still serves: the attempt loads them itself and reports what was wrong."""
    if spec_path is None:
        return None, {}
    from qlora_supervise.trainer_child.__main__ import read_spec
    from qlora_supervise.trainer_child.recipe.data import prepare

    try:
        prepared = prepare(read_spec(Path(spec_path)))
    except Exception as exc:
        return None, {"prepare_error": f"{type(exc).__name__}: {exc}"[:500]}
    return prepared, {"prepare_s": prepared.seconds}


def check_spec(spec: AttemptSpec, device_name: str, expandable_segments: bool) -> str | None:
    """Why this spare cannot run ``spec`` (its environment was fixed for another), or None."""
    if spec.device != device_name:
        return f"the spec's device {spec.device!r} is not the spare's {device_name!r}"
    if spec.knobs.world_size > 1:
        return "the spec is for several processes (torchrun starts its ranks itself)"
    if spec.knobs.expandable_segments != expandable_segments:
        return "the spec's expandable_segments differs from the allocator setting the spare started with"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qlora_supervise.trainer_child.run.spare")
    parser.add_argument("--run-dir", required=True, help="the run directory it serves (names it for reclaim)")
    parser.add_argument("--device", required=True, help="the job's resources.device")
    parser.add_argument("--expandable-segments", action="store_true", help="allocator setting of the attempt")
    parser.add_argument("--model", help="the model directory, whose architecture's module it imports")
    parser.add_argument("--prepare", help="an attempt's spec whose tokenizer and rows to load ahead")
    args = parser.parse_args(argv)
    try:
        ready = warm_up(args.device, args.expandable_segments, args.model)
    except DeviceError as exc:
        print(f"trainer child spare: {exc}", file=sys.stderr)
        return int(ExitCode.CONFIG)
    prepared, cost = prepare_ahead(args.prepare)
    # The RSS once prepared: what the supervisor budgets the next spare's host RAM by.
    print(json.dumps(ready | cost | {"rss": proc_status_bytes("VmRSS")}), flush=True)
    line = sys.stdin.readline()
    if not line.strip():
        return 0  # discarded, or the supervisor is gone: nothing was started
    order = json.loads(line)
    # Acknowledged before anything that could block: a spare that says nothing within seconds is
    # discarded and the attempt starts cold, instead of waiting for the hang timeout.
    print(json.dumps({"event": "spare_ack", "pid": os.getpid(), "spec": order.get("spec")}), flush=True)
    # stdout and stderr (the descriptors: native code follows) to the attempt's log, opened as the
    # supervisor opens a child's log (never through a link, the run's file mode).
    sys.stdout.flush()
    sys.stderr.flush()
    fd = os.open(order["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o640)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    from qlora_supervise.trainer_child.__main__ import spec_or_none

    if (spec := spec_or_none(Path(order["spec"]))) is None:
        return int(ExitCode.CONFIG)
    if (why := check_spec(spec, args.device, args.expandable_segments)) is not None:
        print(f"trainer child spare: {why}", file=sys.stderr)
        return int(ExitCode.CONFIG)
    from qlora_supervise.trainer_child.run.attempt import run

    return run(spec, prepared)


if __name__ == "__main__":
    leave(main())
