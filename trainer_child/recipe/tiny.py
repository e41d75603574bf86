"""A tiny Llama-shaped model, tokenizer, dataset and job, built locally with no download:
``python -m qlora_supervise.trainer_child.recipe.tiny DIR [--family F]`` writes ``DIR/model`` (with a
word-level tokenizer), ``DIR/data.jsonl`` (``text`` and ``messages``) and ``DIR/job.yaml``: 30 steps
take seconds on 2 cores, every row is longer than 512 tokens (activation memory grows with
``micro_batch_size * max_seq_len``), and the task (counting by a stride) is learnable. ``--family``
writes a random model of that architecture whose job's ``target_modules: attention`` resolves by type."""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the heavy libraries load only when a model is built
    from transformers import PreTrainedModel, PreTrainedTokenizerFast

#: Sized so that activations, not weights, dominate memory: hidden 256, 4 layers.
MODEL_SHAPE = {
    "hidden_size": 256,
    # A multiple of 32: on the CPU in eval mode, bitsandbytes repacks 4-bit weights in 32-row blocks.
    "intermediate_size": 704,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 1024,
}
#: The other families' shared sizes (every Linear's output a multiple of 32, as above).
FAMILY_SHAPE: dict[str, object] = dict(
    MODEL_SHAPE, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_key_value_heads=2
)
#: ``model_type`` -> what its config needs beyond :data:`FAMILY_SHAPE` to be that family in small (a
#: sliding window shorter than the test's sequences, a few experts of which two are routed).
_GEMMA: dict[str, object] = {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 64}
FAMILIES: dict[str, dict[str, object]] = {
    "gemma2": _GEMMA,
    "gemma3_text": _GEMMA | {"layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {},  # fused qkv_proj and gate_up_proj are the family's whole difference
    "qwen3": {"head_dim": 16},
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
}
ROWS = 320
#: Model vocabulary: larger than the ~20 words the data uses, like a real model's.
VOCAB_SIZE = 1024
SPECIAL_TOKENS = ["<pad>", "<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>"]
#: Assistant output (with its end-of-turn token) sits inside ``{% generation %}`` markers, so
#: trl's assistant-only loss can mask the user's turns (``return_assistant_tokens_mask``).
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "<|assistant|> {% generation %}{{ m['content'] }} </s>{% endgeneration %} "
    "{% else %}<|{{ m['role'] }}|> {{ m['content'] }} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def spell(number: int) -> str:
    """Digits as separate words: a ~15-word vocabulary the loss can learn within a few steps."""
    return " ".join(str(number))


def tiny_rows(count: int = ROWS, seed: int = 0) -> list[dict[str, object]]:
    """Counting exercises (the prompt determines the answer), each over 600 tokens: truncated to
    ``max_seq_len`` (up to 512) every batch has the same shape."""
    rng = random.Random(seed)
    rows: list[dict[str, object]] = []
    for index in range(count):
        stride, start, length = rng.randint(1, 3), rng.randint(100, 900), rng.randint(140, 160)
        prompt = f"row {spell(index)} count by {stride} from {spell(start)}"
        answer = " , ".join(spell(start + stride * k) for k in range(length))
        messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]
        rows.append({"text": f"<|user|> {prompt} <|assistant|> {answer}", "messages": messages})
    return rows


def build_tokenizer(rows: list[dict[str, object]]) -> PreTrainedTokenizerFast:
    """A word-level tokenizer trained on the dataset: no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel(unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=SPECIAL_TOKENS)
    core.train_from_iterator([str(row["text"]) for row in rows], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template=CHAT_TEMPLATE,
        model_max_length=MODEL_SHAPE["max_position_embeddings"],
    )


def build_model(vocab_size: int, family: str | None = None) -> PreTrainedModel:
    """Random weights (a fixed seed) of the Llama demo model, or of ``family`` (a key of :data:`FAMILIES`,
    with its own tie default: Gemma ties its embeddings)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    tokens = {"vocab_size": vocab_size, "pad_token_id": 0, "bos_token_id": 2, "eos_token_id": 3}
    shape = (
        {**MODEL_SHAPE, "tie_word_embeddings": False} if family is None else FAMILY_SHAPE | FAMILIES[family]
    )
    config = AutoConfig.for_model(family or "llama", **tokens, **shape)
    model: PreTrainedModel = AutoModelForCausalLM.from_config(config)  # type: ignore[no-untyped-call]
    return model


def job_yaml(targets: str = "[q_proj, k_proj, v_proj, o_proj]") -> str:
    """The tiny job in the job.yaml schema (paths relative to the job file's directory)."""
    return f"""\
model: {{path: ./model, fallbacks: [], trust_remote_code: false}}
data: {{path: ./data.jsonl, text_field: text, messages_field: null, eval_path: null, eval_fraction: 0.0}}
quantization: {{load_in_4bit: true, quant_type: nf4, double_quant: true, compute_dtype: auto}}
lora: {{r: 8, alpha: 16, dropout: 0.05, target_modules: {targets}}}
train: {{max_seq_len: 256, micro_batch_size: 1, effective_batch_size: 8, gradient_checkpointing: false,
        optimizer: paged_adamw_8bit, learning_rate: 2.0e-3, lr_scheduler: cosine, warmup_ratio: 0.03,
        max_grad_norm: 0.3, max_steps: 30, epochs: null, save_steps: 10, logging_steps: 1,
        eval_steps: null, packing: false, seed: 42, merge: false}}
resources: {{gpu: auto, gpu_memory_limit: null, cpu_memory_limit: null}}
supervise: {{max_attempts: 8, hang_timeout: 20m}}
output_dir: ./run
"""


def write_tiny(directory: Path, family: str | None = None) -> Path:
    """Write model, tokenizer, dataset and job under ``directory``; the job file's path."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    rows = tiny_rows()
    (directory / "data.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    tokenizer = build_tokenizer(rows)
    build_model(max(VOCAB_SIZE, len(tokenizer)), family).save_pretrained(directory / "model")
    tokenizer.save_pretrained(directory / "model")
    job = directory / "job.yaml"
    job.write_text(job_yaml() if family is None else job_yaml(targets="attention"), encoding="utf-8")
    return job


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qlora_supervise.trainer_child.recipe.tiny")
    parser.add_argument("directory", type=Path)
    parser.add_argument(
        "--family", choices=sorted(FAMILIES), help="a tiny model of this architecture (default: Llama)"
    )
    args = parser.parse_args(argv)
    print(write_tiny(args.directory, args.family))
    return 0


if __name__ == "__main__":
    sys.exit(main())
