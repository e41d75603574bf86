"""The child's ``python -m`` entry points, named once: the supervisor starts them by these names
and never imports them (they import torch)."""

from __future__ import annotations

_PACKAGE = "qlora_supervise.trainer_child"
#: One attempt: ``python -m ATTEMPT --spec attempt-NNN/spec.json`` (trainer_child/__main__.py).
ATTEMPT = _PACKAGE
#: A warm spare that waits on stdin for the next attempt's spec.
SPARE = f"{_PACKAGE}.run.spare"
#: The adapter merged into the base model, in its own process.
MERGE = f"{_PACKAGE}.merge.process"
#: The tiny Llama-shaped model, tokenizer and dataset for the demo and the tests.
TINY = f"{_PACKAGE}.recipe.tiny"
#: Prints the data segment after the training stack's imports; with :data:`STACK_BYTES` only bytes.
STACK = f"{_PACKAGE}.recipe.stack"
STACK_BYTES = "--bytes"
