"""Where an attempt's start goes once the stack is imported: cProfile of the recipe's build.

    python bench/recovery/profile_start.py --scenario 7b-8GiB --out OUT/profile.txt [--cache DIR]

A fresh process does what a warm spare and then an attempt do (the attempt's environment, the
imports, CUDA, the memory cap), then profiles ``recipe.build``: tokenizer, 4-bit load, k-bit
preparation, LoRA, data and the trainer, up to the first training step (not run). Writes the
build's phases (as ``trainer_ready`` logs them) and the functions by cumulative and by own time,
for finding what a spare could do ahead.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from recovery import jobs
from recovery.scenarios import SCENARIOS

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="7b-8GiB", choices=[s.name for s in SCENARIOS])
    p.add_argument("--cache", type=Path, default=ROOT / "build" / "recovery-cache")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--top", type=int, default=45)
    p.add_argument("--cold", action="store_true", help="as a cold child: no spare's warm-up of classes")
    args = p.parse_args()
    s = next(x for x in SCENARIOS if x.name == args.scenario)
    run_dir = Path(tempfile.mkdtemp(prefix="profile-", dir=args.cache))
    job = jobs.write_job(s, args.cache / s.shape, run_dir, tiny=False)
    spec = jobs.placed(jobs.job_spec(job), run_dir, 1, None)
    Path(spec.events_file).parent.mkdir(parents=True, exist_ok=True)

    text = profile(spec, args.top, warm=not args.cold)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text, encoding="utf-8")
    print(text[:3000])
    return 0


def profile(spec: Any, top: int, warm: bool) -> str:
    """The attempt's start in this process, the build under cProfile; the report's text."""
    from qlora_supervise.supervisor.loop.child import child_env
    from qlora_supervise.trainer_child.__main__ import prepare_env

    os.environ.update(child_env(dict(os.environ), spec.knobs))  # allocator settings before torch
    prepare_env(spec)
    started = time.monotonic()
    import torch

    from qlora_supervise.trainer_child.recipe.stack import import_training_classes, import_training_stack

    import_training_stack()
    if warm:
        import_training_classes(spec.knobs.model)
    imports_s = time.monotonic() - started
    from qlora_supervise.trainer_child.contract.checkpoints import ResumeSource
    from qlora_supervise.trainer_child.recipe import qlora as recipe
    from qlora_supervise.trainer_child.run import memory
    from qlora_supervise.trainer_child.run.heartbeat import EventLog, Progress

    started = time.monotonic()
    on_cuda = torch.cuda.is_available()
    if on_cuda:
        torch.cuda.init()  # type: ignore[no-untyped-call]
        memory.apply_gpu_cap(spec.gpu_memory_limit)
    cuda_s = time.monotonic() - started
    progress = Progress(EventLog(spec.events_file))
    profiler = cProfile.Profile()
    started = time.monotonic()
    profiler.enable()
    recipe.build(spec, progress, on_cuda, ResumeSource())
    profiler.disable()
    build_s = time.monotonic() - started
    lines = Path(spec.events_file).read_text(encoding="utf-8").splitlines()
    ready = next((line for line in lines if "trainer_ready" in line), "")
    out = io.StringIO()
    out.write(f"imports {imports_s:.2f} s, CUDA and cap {cuda_s:.2f} s, build {build_s:.2f} s (profiled)\n")
    out.write(f"trainer_ready: {ready}\n\n")
    for order in ("cumulative", "tottime"):
        pstats.Stats(profiler, stream=out).sort_stats(order).print_stats(top)
    return out.getvalue()


if __name__ == "__main__":
    sys.exit(main())
