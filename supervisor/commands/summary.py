"""The summary ``run`` and ``demo`` end with: the retry story, what changed, where the adapter is,
and the lines that load it with PEFT."""

from __future__ import annotations

from typing import TextIO

from qlora_supervise.supervisor.commands.status import print_story
from qlora_supervise.supervisor.record.journal import read_attempts
from qlora_supervise.supervisor.record.records import Phase
from qlora_supervise.supervisor.record.rundir import RunDir


def print_summary(rd: RunDir, out: TextIO) -> None:
    print("\n--- the retry story (qlora-supervise status) ---", file=out)
    print_story(rd, out)
    records, _ = read_attempts(rd.attempts)
    train = [r for r in records if r.phase is Phase.TRAIN]
    if not train:
        return
    first, last = train[0].knobs, train[-1].knobs
    changed = [
        f"{name} {getattr(first, name)} -> {getattr(last, name)}"
        for name in _knob_names()
        if getattr(first, name) != getattr(last, name)
    ]
    print(f"changed by the ladder: {', '.join(changed) if changed else 'nothing'}", file=out)
    if rd.adapter.exists():
        for line in load_lines(str(rd.adapter), last.model, str(rd.merged) if rd.merged.exists() else None):
            print(line, file=out)


def _knob_names() -> list[str]:
    import dataclasses

    from qlora_supervise.trainer_child.contract.spec import Knobs

    return [f.name for f in dataclasses.fields(Knobs)]


def load_lines(adapter: str, base_model: str, merged: str | None) -> list[str]:
    """Python that loads the result: the base in 4-bit plus the adapter, or the merged model."""
    lines = [
        "load the adapter (PEFT):",
        "  import torch",
        "  from peft import PeftModel",
        "  from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig",
        f"  base = AutoModelForCausalLM.from_pretrained({base_model!r}, device_map='auto',",
        "      quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4',",
        "          bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16))",
        f"  model = PeftModel.from_pretrained(base, {adapter!r})",
        f"  tokenizer = AutoTokenizer.from_pretrained({adapter!r})",
    ]
    if merged is not None:
        lines += [
            "or the merged model (no PEFT needed):",
            f"  model = AutoModelForCausalLM.from_pretrained({merged!r}, dtype='auto', device_map='auto')",
        ]
    return lines
