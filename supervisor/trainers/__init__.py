"""The trainer seam: our own child or a tool the user already runs (``trl sft``, axolotl, LLaMA-Factory,
an HfArgumentParser script), each a :class:`~qlora_supervise.supervisor.facts.trainer.Trainer`.

One module per tool in :mod:`.tools` exports its :class:`.tool.Tool` record; :mod:`.trainer` runs
any of them (each attempt's config, its argv), :mod:`.job` loads a job of either kind.
"""
