"""``lora.target_modules`` checked against the model's own layer names, before any child starts.

The names come from the safetensors headers (or the index), read by :mod:`.model_files`: no
torch, no weights. The keywords ``attention`` / ``mlp`` / ``all-linear`` resolve by the config's
``model_type`` through the table the child uses too
(:mod:`qlora_supervise.trainer_child.contract.targets`), so Phi-3's fused ``qkv_proj`` or a MoE's
fused experts are caught here, not after the weights loaded.
"""

from __future__ import annotations

from qlora_supervise.supervisor.jobfile.model_files import ModelFiles
from qlora_supervise.supervisor.jobfile.problems import Problem, show
from qlora_supervise.trainer_child.contract.targets import (
    TargetsError,
    check,
    expert_leaves,
    linear_leaves,
    resolve,
)

FIELD = "lora.target_modules"


def target_problems(targets: tuple[str, ...] | str, files: ModelFiles) -> list[Problem]:
    """Why ``targets`` cannot adapt the model in ``files`` (empty: they can, or nothing tells).

    Any name that matches no Linear layer is a problem, not only all of them: Llama names on
    Phi-3 would match ``o_proj`` and ``down_proj`` alone. Skipped (empty) where the header holds
    no transformer block (a ``.bin`` checkpoint, an index without its shards, a partial file) and
    the targets need names to check; a keyword the table cannot resolve is a problem either way.
    """
    raw_type = files.config.get("model_type")
    model_type = str(raw_type) if raw_type else None
    layers = linear_leaves(files.tensors, model_type)
    shown = show(list(targets) if isinstance(targets, tuple) else targets)
    try:
        if layers:
            check(targets, model_type, layers, expert_leaves(files.tensors))
        else:
            resolve(targets, model_type)  # nothing to match names against: the keyword alone
    except TargetsError as error:
        return [Problem(FIELD, error.problem, shown, error.fix)]
    return []
