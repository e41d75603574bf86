"""``qlora-supervise make-tiny`` and ``qlora-supervise demo``: the tiny model (built in a child process:
the supervisor never imports torch), then a job whose first config does not fit a deliberately small
memory cap, so the child hits real allocation failures and the ladder must find a config that fits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from qlora_supervise.supervisor.commands.run import run_job
from qlora_supervise.supervisor.exit_codes import SupervisorExit, SupervisorExitCode
from qlora_supervise.supervisor.facts.units import format_bytes
from qlora_supervise.supervisor.watching.gpu import visible_gpu_count
from qlora_supervise.trainer_child.contract import processes

#: The demo's first config: about 1.7 GiB of data segment on the tiny model, 1.2 GiB with gradient
#: checkpointing; the cap sits between, so the forward ladder's first rung fits (docs/planning.md,
#: "The CPU cap").
DEMO_TRAIN = {
    "micro_batch_size": 16,
    "effective_batch_size": 16,
    "gradient_checkpointing": False,
    "max_seq_len": 512,
    "max_steps": 12,
    "save_steps": 4,
    "logging_steps": 1,
}
#: The CPU cap is this far above the child's data segment after its imports (0.37 GiB with a CPU torch).
DEMO_CPU_HEADROOM = 970 * 2**20
#: On a GPU the same two configs peak at 830 MiB and 385 MiB allocated (H200): the cap sits between.
DEMO_GPU_CAP = "640MiB"


def make_tiny_command(directory: str | Path) -> int:
    """Write the tiny model, dataset and job.yaml into ``directory``; the child's exit status."""
    return subprocess.run([sys.executable, "-m", processes.TINY, str(directory)], check=False).returncode


def demo_command(directory: str) -> int:
    root = Path(directory).resolve()
    tiny = root / "tiny"
    if not (tiny / "job.yaml").exists():
        print(f"making the tiny model in {tiny} ...", file=sys.stderr, flush=True)
        if make_tiny_command(tiny) != 0:
            why = "could not build the tiny model (see above)"
            raise SupervisorExit(SupervisorExitCode.NOT_RETRYABLE, why)
    baseline = None  # a GPU NVML can see: the demo caps GPU memory instead of the CPU data segment
    if not visible_gpu_count():  # the trainer child's data segment after its imports on this machine
        command = [sys.executable, "-m", processes.STACK, processes.STACK_BYTES]
        out = subprocess.run(command, check=False, capture_output=True, text=True)
        if out.returncode != 0 or not out.stdout.strip().isdigit():
            stack = "torch, transformers, peft, trl, bitsandbytes"
            why = f"could not import the training stack ({stack}): {out.stderr.strip()[-2000:]}"
            raise SupervisorExit(SupervisorExitCode.NOT_RETRYABLE, why)
        baseline = int(out.stdout.strip())
    cpu_cap = None if baseline is None else f"{(baseline + DEMO_CPU_HEADROOM) // 2**20}MiB"
    job_path = write_demo_job(tiny / "job.yaml", root, cpu_cap)
    print(f"supervising {job_path} ({cap_words(baseline)}: the first config will not fit)", file=sys.stderr)
    return run_job(str(job_path))  # ends with the summary: the retry story and how to load the adapter


def cap_words(baseline: int | None) -> str:
    """The demo's cap for a person, with where a CPU cap comes from (``baseline``: None on a GPU)."""
    if baseline is None:
        return f"gpu_memory_limit {DEMO_GPU_CAP}"
    cap = (baseline + DEMO_CPU_HEADROOM) // 2**20 * 2**20
    imports = f"the trainer's {format_bytes(baseline)} after its imports + {format_bytes(DEMO_CPU_HEADROOM)}"
    return f"cpu_memory_limit {format_bytes(cap)}: {imports}"


def write_demo_job(tiny_job: Path, root: Path, cpu_cap: str | None) -> Path:
    """The tiny job with a first config too big for the demo's memory cap."""
    job: dict[str, Any] = yaml.safe_load(tiny_job.read_text(encoding="utf-8"))
    for key in ("model", "data"):
        job[key]["path"] = str((tiny_job.parent / job[key]["path"]).resolve())
    job["train"].update(DEMO_TRAIN)
    gpu = {"gpu": 0, "gpu_memory_limit": DEMO_GPU_CAP}
    job["resources"] = gpu if cpu_cap is None else {"gpu": "cpu", "cpu_memory_limit": cpu_cap}
    job.setdefault("supervise", {})["hang_timeout"] = "5m"
    job["output_dir"] = str(root / "run")
    path = root / "demo-job.yaml"
    path.write_text(yaml.safe_dump(job, sort_keys=False), encoding="utf-8")
    return path
