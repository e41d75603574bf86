"""The heavy import stack of an attempt, in one place, and the data segment it costs.

``python -m qlora_supervise.trainer_child.stack`` prints the child's data segment (VmData)
after these imports on this machine, in bytes: the fixed cost under a CPU memory cap, which
the cap is applied after (a CPU build of torch costs ~0.4 GiB here, a CUDA build ~2.3 GiB).
The demo uses it to place its cap the same distance above the baseline everywhere.
"""

from __future__ import annotations

import os
import sys


def import_training_stack() -> dict[str, str]:
    """Import torch, bitsandbytes, peft, transformers and trl; return their versions."""
    import bitsandbytes
    import peft
    import torch
    import transformers
    import trl

    return {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "trl": trl.__version__,
        "bitsandbytes": bitsandbytes.__version__,
    }


def main() -> int:
    from .memory import prepare_process_env, proc_status_bytes

    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # as a CPU attempt: the cap baseline is a CPU one
    prepare_process_env(expandable_segments=False)
    import torch

    torch.cuda.is_available()
    import_training_stack()
    print(proc_status_bytes("VmData") or 0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
