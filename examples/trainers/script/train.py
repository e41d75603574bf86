"""QLoRA on a base model as the tutorials write it: every setting in the code, no flags.

It knows nothing of qlora-supervise and is never edited by it. Run alone: ``python train.py``.
Supervised, unchanged (``job.yaml`` beside it): ``qlora-supervise run job.yaml``; after an OOM the
next attempt's micro-batch, accumulation, checkpointing, optimizer, sequence length or LoRA rank
are changed where this script builds them.
"""

import torch
from datasets import load_dataset
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
from trl import SFTConfig, SFTTrainer

model_id = "models/llama-2-7b"  # a local copy of the base model
on_gpu = torch.cuda.is_available()

bnb_config = BitsAndBytesConfig(
    load_in_4bit=True,
    bnb_4bit_quant_type="nf4",
    bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype=torch.bfloat16 if on_gpu else torch.float32,
)
tokenizer = AutoTokenizer.from_pretrained(model_id)
if tokenizer.pad_token is None:
    tokenizer.pad_token = tokenizer.eos_token
model = AutoModelForCausalLM.from_pretrained(model_id, quantization_config=bnb_config)
model.config.use_cache = False
model = prepare_model_for_kbit_training(model)

lora_config = LoraConfig(
    r=8,
    lora_alpha=16,
    lora_dropout=0.05,
    target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
    task_type="CAUSAL_LM",
)
model = get_peft_model(model, lora_config)

dataset = load_dataset("json", data_files="data/train.jsonl", split="train")

args = SFTConfig(
    output_dir="llama-2-7b-qlora",
    per_device_train_batch_size=16,
    gradient_accumulation_steps=1,
    optim="adamw_torch",
    learning_rate=2e-4,
    max_steps=500,
    save_steps=50,
    logging_steps=10,
    max_length=256,
    bf16=on_gpu,
    report_to="none",
    seed=42,
)
trainer = SFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer)
trainer.train()
trainer.save_model()
