"""Check the trainer child's CUDA memory paths on a real GPU (torch only, no trl/bnb needed).

    python bench/child_gpu_probe.py [on|off]

Sets the allocator env the way ``__main__`` does, caps the process with
``set_per_process_memory_fraction``, reads back expandable segments from the allocator, then
allocates past the cap and prints what the error report would carry. Not a test.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    from qlora_supervise.trainer_child.run.memory import prepare_process_env

    prepare_process_env(expandable_segments=sys.argv[1:2] != ["off"])
    import torch

    from qlora_supervise.trainer_child.contract.codes import Stage
    from qlora_supervise.trainer_child.run import memory
    from qlora_supervise.trainer_child.run.failure import capture

    memory.apply_gpu_cap(4 << 30)
    print("expandable_segments_active", memory.expandable_segments_active())
    keep = [torch.empty(1 << 30, dtype=torch.uint8, device="cuda") for _ in range(3)]
    print("numbers", json.dumps(memory.memory_numbers()))
    try:
        keep.append(torch.empty(2 << 30, dtype=torch.uint8, device="cuda"))
    except Exception as exc:
        failure = capture(exc, Stage.FORWARD, 7)
        print("exit_code", int(failure.exit_code), "oom", failure.oom)
        print("message", failure.message[:400])
        from qlora_supervise.trainer_child.run.failure import oom_numbers

        print("oom_numbers", oom_numbers(failure.message))
    stats = memory.cuda_memory_stats() or {}
    print("stats keys", len(stats), stats.get("num_ooms"))


if __name__ == "__main__":
    main()
