"""A LoRA fine-tune built on transformers.HfArgumentParser and Trainer, as many people write one.

It knows nothing of qlora-supervise: the supervisor starts it with new flags per attempt
(``--per_device_train_batch_size`` etc.) and its shim supervises the Trainer built here.

    python train.py --model_name_or_path MODEL --dataset_path data.jsonl --output_dir out \\
        --per_device_train_batch_size 4 --gradient_accumulation_steps 4 --max_seq_length 512
"""

from dataclasses import dataclass, field

from datasets import load_dataset
from peft import LoraConfig, get_peft_model
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    Trainer,
    TrainingArguments,
)


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a local model directory"})
    dataset_path: str = field(metadata={"help": "a jsonl file with a text field"})
    max_seq_length: int = 512
    lora_r: int = 8
    lora_alpha: int = 16


def main() -> None:
    script, training = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path)
    lora = LoraConfig(
        r=script.lora_r,
        lora_alpha=script.lora_alpha,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        task_type="CAUSAL_LM",
    )
    model = get_peft_model(model, lora)
    rows = load_dataset("json", data_files=script.dataset_path, split="train")
    rows = rows.map(
        lambda r: tokenizer(r["text"], truncation=True, max_length=script.max_seq_length),
        remove_columns=rows.column_names,
    )
    trainer = Trainer(
        model=model,
        args=training,
        train_dataset=rows,
        processing_class=tokenizer,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.train(resume_from_checkpoint=training.resume_from_checkpoint)
    trainer.save_model(training.output_dir)


if __name__ == "__main__":
    main()
