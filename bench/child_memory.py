"""Peak memory and time of the trainer child on the tiny model, per config (CPU).

    python bench/child_memory.py [TINY_DIR]      # default /tmp/tiny, built first when missing

Runs each config for a few optimizer steps (effective batch 16) and prints the peak data
segment (what RLIMIT_DATA caps), the peak RSS and the wall time. Used to choose the
``cpu_memory_limit`` of the OOM demo. Not a test.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _child import events, log_tail, make_spec, run_child

from qlora_supervise.trainer_child.contract.events import Heartbeat

CONFIGS = [  # (micro_batch, seq_len, gradient_checkpointing)
    (16, 512, False),
    (8, 512, False),
    (4, 512, False),
    (2, 512, False),
    (1, 512, False),
    (16, 512, True),
    (8, 512, True),
    (16, 256, False),
    (8, 256, False),
    (4, 256, False),
    (1, 256, False),
]


def measure(tiny: Path, micro: int, seq: int, checkpointing: bool, steps: int = 2) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as run:
        spec = make_spec(
            tiny,
            Path(run),
            knobs={
                "micro_batch_size": micro,
                "grad_accum": 16 // micro,
                "max_seq_len": seq,
                "gradient_checkpointing": checkpointing,
            },
            train={"max_steps": steps, "save_steps": 100},
        )
        start = time.monotonic()
        code = run_child(spec, timeout=600)
        wall = time.monotonic() - start
        beats = [b for e in events(spec) if e["event"] == "heartbeat" and (b := Heartbeat.from_fields(e))]
        started = next((e for e in events(spec) if e["event"] == "started"), {})
        if code != 0 and not beats:
            print(
                f"  the child exited {code} before a heartbeat; its log:\n{log_tail(spec, 1500)}", flush=True
            )
        return {
            "rc": code,
            "wall_s": round(wall, 1),
            "vmdata_after_imports": started.get("vmdata") or 0,
            # On the CPU the child's peak is the data segment's (contract.events.MemoryNumbers).
            "peak_vmdata": max((b.memory.peak_bytes or 0 for b in beats), default=0),
            "peak_rss": max((b.memory.rss_high_water_bytes or 0 for b in beats), default=0),
        }


def main() -> None:
    tiny = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("/tmp/tiny")
    if not (tiny / "model" / "config.json").is_file():
        print(f"building the tiny model in {tiny} ...", flush=True)
        make = [sys.executable, "-m", "qlora_supervise.trainer_child.recipe.tiny", str(tiny)]
        subprocess.run(make, check=True, capture_output=True)
    mib = 1 << 20
    for micro, seq, ckpt in CONFIGS:
        row = measure(tiny, micro, seq, ckpt)
        print(
            f"micro={micro:2d} seq={seq} ckpt={ckpt!s:5} rc={row['rc']} wall={row['wall_s']:5.1f}s "
            f"peak_vmdata={row['peak_vmdata'] / mib:6.0f}MiB peak_rss={row['peak_rss'] / mib:6.0f}MiB "
            f"(imports {row['vmdata_after_imports'] / mib:.0f}MiB)",
            flush=True,
        )


if __name__ == "__main__":
    main()
