"""The merge test's torch side (tests only), run as a subprocess so pytest never imports torch.

``python merge_check.py adapter MODEL OUT``: a LoRA adapter on the tiny model with non-zero
random B matrices (peft initialises B to zero, which would make any merge look right), saved
with the tokenizer as training saves it.
``python merge_check.py compare MODEL ADAPTER MERGED``: logits of the merged model against the
base + adapter unmerged (fp32), as JSON.
"""

from __future__ import annotations

import json
import sys

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer


def make_adapter(model: str, out: str) -> None:
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    peft_model = get_peft_model(base, lora)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.05)
    peft_model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model).save_pretrained(out)


def compare(model: str, adapter: str, merged: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model)
    ids = tokenizer(["the quick brown fox jumps over the lazy dog"] * 2, return_tensors="pt").input_ids
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
        plain = base(ids).logits
        reference = PeftModel.from_pretrained(base, adapter)(ids).logits
        loaded = AutoModelForCausalLM.from_pretrained(merged)
        out = loaded(ids).logits.float()
    dtypes = sorted({str(p.dtype) for p in loaded.parameters()})
    print(
        json.dumps(
            {
                "max_abs_diff": float((out - reference).abs().max()),
                "adapter_effect": float((reference - plain).abs().max()),
                "logit_scale": float(reference.abs().max()),
                "dtypes": dtypes,
                "has_lora": any("lora" in n for n, _ in loaded.named_parameters()),
            }
        )
    )


if __name__ == "__main__":
    if sys.argv[1] == "adapter":
        make_adapter(sys.argv[2], sys.argv[3])
    else:
        compare(sys.argv[2], sys.argv[3], sys.argv[4])
