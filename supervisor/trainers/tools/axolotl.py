"""axolotl: ``python -m axolotl.cli.train <config>``."""

from __future__ import annotations

from qlora_supervise.supervisor.trainers import tool
from qlora_supervise.supervisor.trainers.mapping import lookup
from qlora_supervise.supervisor.trainers.tool import Config, Contradiction, Row, Table, Tool

#: axolotl's gradient_checkpointing values that checkpoint with the saved activations elsewhere: on.
_OFFLOAD = ("offload", "offload_disk")

TABLE = Table(
    "axolotl",
    rows=(
        Row("model", "base_model", None),
        Row("micro_batch_size", "micro_batch_size", 1),
        Row("grad_accum", "gradient_accumulation_steps", 1),
        Row("gradient_checkpointing", "gradient_checkpointing", False, read=lambda v: v in _OFFLOAD or v),
        Row("optimizer", "optimizer", "adamw_torch_fused"),
        Row("max_seq_len", "sequence_len", 512),
        Row("lora_r", "lora_r", None),
        Row("lora_alpha", "lora_alpha", None),
        Row("load_in_4bit", "load_in_4bit", False, read_only=True),
        # axolotl's qlora loader: nf4 with double quantization unless bnb_config_kwargs says otherwise.
        Row("quant_type", "bnb_config_kwargs.bnb_4bit_quant_type", "nf4"),
        Row("double_quant", "bnb_config_kwargs.bnb_4bit_use_double_quant", True),
        # None: axolotl uses micro_batch_size (utils/config normalize_config).
        Row("eval_batch_size", "eval_batch_size", lambda config: config.get("micro_batch_size") or 1),
        # A split of the training data (val_set_size) or test_datasets; read only: rungs change the batch.
        Row(
            "eval_enabled",
            "val_set_size",
            lambda config: 1.0 if config.get("test_datasets") else 0.0,
            read=lambda v: v > 0 if isinstance(v, (int, float)) and not isinstance(v, bool) else v,
            read_only=True,
        ),
    ),
    required={
        "base_model": "add base_model: a local model directory (the child runs offline)",
        "adapter": "add adapter: qlora (or lora): the supervisor supervises LoRA / QLoRA fine-tunes",
        "lora_r": "add lora_r (axolotl has no default rank)",
        "lora_alpha": "add lora_alpha (axolotl has no default)",
    },
    contradictions=(
        *tool.restarts("micro_batch_size", "gradient_accumulation_steps"),
        Contradiction(
            "auto_resume_from_checkpoints",
            tool.is_true,
            "axolotl would pick its own checkpoint in output_dir, not the one the supervisor checked",
            "delete auto_resume_from_checkpoints: the supervisor resumes from its newest complete checkpoint",
        ),
        tool.lora_only("adapter", ("qlora", "lora")),
        Contradiction(
            "batch_size",
            tool.present,
            "which accumulation it means depends on the axolotl version (0.19 trains at "
            "gradient_accumulation_steps 1 and counts steps by batch_size; older ones derived it)",
            "delete batch_size and write gradient_accumulation_steps: batch_size / micro_batch_size",
        ),
        # axolotl's schema refuses it at load; here it is named at validate, before a card is taken.
        Contradiction(
            "adapter",
            lambda v: v == "qlora",
            'qlora without load_in_4bit: true: axolotl stops at load ("Require cfg.load_in_4bit to be '
            'True for qlora")',
            "set load_in_4bit: true (or adapter: lora for a LoRA on unquantized weights)",
            given=lambda config: config.get("load_in_4bit") is not True and not config.get("merge_lora"),
        ),
        *tool.TRAINER_ARGUMENTS_CONTRADICTIONS,
        Contradiction("fsdp_config", tool.present, tool.MULTI_GPU, "delete fsdp_config"),
    ),
    data_key="datasets",
    epochs_key="num_epochs",
    epochs_default=1.0,
    reads_quoted_numbers=True,
)


def _attention(config: Config) -> str | None:
    """``attn_implementation``, else its older ``eager_attention: true``."""
    implementation = lookup(config, "attn_implementation")
    if not isinstance(implementation, str) and lookup(config, "eager_attention") is True:
        return "eager"
    return tool.attn_implementation(config)


TOOL = Tool(
    TABLE,
    package="axolotl",
    entry=("-m", "axolotl.cli.train"),
    all_linear_key="lora_target_linear",
    attention=_attention,
)
