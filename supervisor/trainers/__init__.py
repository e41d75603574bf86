"""The trainer seam: our own child or a tool the user already runs (``trl sft``, axolotl, LLaMA-Factory,
an HfArgumentParser script, a script with its settings in its code), each a ``facts.trainer.Trainer``."""
