"""The heavy import stack of an attempt; ``python -m ...recipe.stack [--bytes]`` prints the data segment
(VmData) it costs: the fixed cost a CPU memory cap sits above (CPU torch ~0.4 GiB, CUDA ~2.3)."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import sys
from pathlib import Path

from qlora_supervise.trainer_child.contract.byte_sizes import format_bytes


def import_training_stack() -> dict[str, str]:
    names = ("torch", "transformers", "peft", "trl", "bitsandbytes")
    return {name: str(importlib.import_module(name).__version__) for name in names}


def import_training_classes(model_dir: str | None = None) -> None:
    """Import ahead what the recipe imports lazily (and ``model_dir``'s modelling module), and do a first
    load's one-off work: transformers' checkpoint-renaming table (a private cache in 5.x, 0.6 s of regexes
    on CI) and a first construction (on the meta device, dropped); no CUDA."""
    from qlora_supervise.trainer_child.recipe import data, qlora, trainer  # noqa: F401 - loaded ahead

    if model_dir is None:
        return
    try:
        model_type = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))["model_type"]
        from transformers.models.auto.configuration_auto import model_type_to_module_name

        module = model_type_to_module_name(str(model_type))
        importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    except (OSError, ValueError, KeyError, TypeError, ImportError):
        return  # a hub id, or an architecture this transformers names otherwise: the attempt imports it
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with contextlib.suppress(ImportError):
        from transformers import conversion_mapping

        build = getattr(conversion_mapping, "get_checkpoint_conversion_mapping", None)
        if callable(build):
            build(str(model_type))
    with contextlib.suppress(Exception):  # a speed-up only: what it cannot build is the attempt's to load
        config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]


def main(argv: list[str] | None = None) -> int:
    """Print the import baseline: for a person, or only the byte count with ``--bytes`` (for scripts)."""
    from qlora_supervise.trainer_child.contract.processes import STACK, STACK_BYTES
    from qlora_supervise.trainer_child.run.memory import prepare_process_env, proc_status_bytes

    parser = argparse.ArgumentParser(
        prog=f"python -m {STACK}", description="the training stack's import baseline"
    )
    parser.add_argument(STACK_BYTES, action="store_true", help="print only the byte count (for scripts)")
    args = parser.parse_args(argv)
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # as a CPU attempt: the cap baseline is a CPU one
    prepare_process_env(expandable_segments=False)
    import torch

    torch.cuda.is_available()
    import_training_stack()
    baseline = proc_status_bytes("VmData") or 0
    if args.bytes:
        print(baseline)
    else:
        print(
            f"import baseline: {format_bytes(baseline)} of data segment (VmData) after the training stack's "
            f"imports ({baseline} bytes, torch {torch.__version__}); a cpu_memory_limit must sit above it"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
