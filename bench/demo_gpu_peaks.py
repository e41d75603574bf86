"""Peak GPU memory of the demo's two configs on the tiny model (chooses the demo's GPU cap).

    python bench/demo_gpu_peaks.py [WORK_DIR]

Runs the demo job uncapped on GPU 0 twice, 3 steps each: as the demo starts it (micro-batch
16, seq 512, no gradient checkpointing) and as the first rung leaves it (checkpointing on), and
prints the CUDA allocator's peak from the child's heartbeats. Needs a GPU; not a test.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

from qlora_supervise.supervisor.commands.demo import DEMO_TRAIN
from qlora_supervise.trainer_child.contract.events import MemoryNumbers


def peak(run_dir: Path) -> int:
    events = (run_dir / "attempt-001" / "child-events.jsonl").read_text().splitlines()
    # The child's one peak (contract.events.MemoryNumbers): the CUDA allocator's on a GPU.
    return max(MemoryNumbers.from_fields(json.loads(line)).peak_bytes or 0 for line in events if line.strip())


def main() -> int:
    work = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/demo-gpu").resolve()
    tiny = work / "tiny"
    if not (tiny / "job.yaml").exists():
        subprocess.run(
            [sys.executable, "-m", "qlora_supervise.trainer_child.recipe.tiny", str(tiny)], check=True
        )
    rows = []
    for checkpointing in (False, True):
        job = yaml.safe_load((tiny / "job.yaml").read_text())
        job["model"]["path"] = str(tiny / "model")
        job["data"]["path"] = str(tiny / "data.jsonl")
        job["train"].update({**DEMO_TRAIN, "max_steps": 3, "gradient_checkpointing": checkpointing})
        job["resources"] = {"gpu": 0}
        job["output_dir"] = str(work / f"run-ckpt-{checkpointing}")
        path = work / f"job-ckpt-{checkpointing}.yaml"
        path.write_text(yaml.safe_dump(job))
        cli = [sys.executable, "-m", "qlora_supervise.supervisor.commands.cli", "run", "--plain", str(path)]
        code = subprocess.run(cli, check=False, capture_output=True).returncode
        rows.append((checkpointing, code, peak(Path(job["output_dir"]))))
    print(f"{'checkpointing':>13}  {'exit':>4}  {'peak allocated':>14}")
    for checkpointing, code, value in rows:
        print(f"{checkpointing!s:>13}  {code:>4}  {value / 2**20:>10.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
