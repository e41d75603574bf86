"""Does a waiting warm spare hold the GPU? NVML's answer, on the machine it runs on.

    python bench/spare_probe.py [--device cuda:0] [--out OUT] [--model DIR] [--prepare SPEC]

Starts one spare (``trainer_child.spare``) the way the supervisor does, waits for its
``spare_ready`` line, then asks NVML for every compute process on the device and for the
device's used memory before the spare started and while it waits. ``--model`` and ``--prepare``
give it what the supervisor gives it (the model whose architecture it builds on the meta device,
the spec whose tokenizer and rows it loads), so the probe covers everything it does ahead.
Prints one table; writes ``OUT/spare-probe.json`` when ``--out`` is given. Not a test: it needs
a GPU to say anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.loop import child as child_mod
from qlora_supervise.supervisor.loop.spare import SpareOrder, ready_line, spare_argv
from qlora_supervise.trainer_child.contract.spec import Knobs


def nvml_view(index: int) -> dict[str, Any]:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        used = int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return {"used_bytes": used, "pids": {int(p.pid): int(p.usedGpuMemory or 0) for p in procs}}
    finally:
        pynvml.nvmlShutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", default="none", help="a model directory (default: none)")
    parser.add_argument("--prepare", type=Path, help="an attempt spec to prepare from")
    args = parser.parse_args(argv)
    work = Path(os.environ.get("TMPDIR", "/tmp")) / f"spare-probe-{os.getpid()}"
    work.mkdir(parents=True, exist_ok=True)
    index = int(args.device.split(":", 1)[1]) if ":" in args.device else 0
    before = nvml_view(index)
    env = child_mod.child_env(dict(os.environ), Knobs(model=args.model))
    order = SpareOrder(env, args.device, True, args.model, prepare_from=args.prepare)
    started = time.monotonic()
    proc = child_mod.spawn_spare(spare_argv(work, order, sys.executable), order.env, work / "spare.log", work)
    ready = None
    while ready is None and proc.poll() is None and time.monotonic() - started < 180:
        time.sleep(0.2)
        ready = ready_line(work / "spare.log", proc.pid)
    waited = time.monotonic() - started
    time.sleep(2.0)  # a context would show by now
    during = nvml_view(index)
    proc.send_line("")
    code = proc.popen.wait(timeout=30)
    result = {
        "ready": ready,
        "wall_to_ready_s": round(waited, 2),
        "spare_in_nvml": proc.pid in during["pids"],
        "spare_gpu_bytes": during["pids"].get(proc.pid, 0),
        "device_used_before": before["used_bytes"],
        "device_used_waiting": during["used_bytes"],
        "exit_on_eof": code,
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "spare-probe.json").write_text(json.dumps(result, indent=2))
    facts = ready or {}
    mib = 1 << 20
    print(f"{'spare ready':<28}{ready is not None} after {waited:.1f} s (import {facts.get('import_s')} s)")
    print(f"{'spare RSS':<28}{facts.get('rss', 0) / mib:.0f} MiB")
    print(f"{'prepared':<28}{facts.get('prepare_s', facts.get('prepare_error'))}")
    print(f"{'torch CUDA initialised':<28}{facts.get('cuda_initialized')}")
    print(f"{'spare listed by NVML':<28}{result['spare_in_nvml']} ({result['spare_gpu_bytes']} bytes)")
    used = f"{before['used_bytes'] / mib:.0f} / {during['used_bytes'] / mib:.0f} MiB"
    print(f"{'device used before/waiting':<28}{used}")
    print(f"{'exit status on EOF':<28}{code}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
