"""LoRA target modules by architecture, one table for ``validate`` and the child: what ``attention``, ``mlp``
and ``all-linear`` name in each family, and the layer names a checkpoint gives the loaded model. MoE experts
load as fused 3D parameters (transformers 5), not ``nn.Linear``, so LoRA adapts only their attention."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

ATTENTION = "attention"
MLP = "mlp"
ALL_LINEAR = "all-linear"
#: The words ``lora.target_modules`` accepts instead of a list of names.
KEYWORDS = (ATTENTION, MLP, ALL_LINEAR)


class TargetsError(ValueError):
    """Targets that cannot work on this model: ``problem`` says what, ``fix`` what the model has."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem, self.fix = problem, fix


@dataclass(frozen=True)
class Family:
    """The linear layers of one architecture's decoder block, by their leaf names."""

    name: str  # for people: "Phi-3 / Phi-4-mini"
    attention: tuple[str, ...]
    mlp: tuple[str, ...]  # () when the MLP has no Linear layer LoRA can adapt (fused MoE experts)
    #: Leaf names of the MoE router's weight: in the checkpoint, but no Linear layer once loaded.
    router: tuple[str, ...] = ()

    @property
    def moe(self) -> bool:
        return bool(self.router)

    @property
    def linear(self) -> tuple[str, ...]:
        return self.attention + self.mlp


_QKVO = ("q_proj", "k_proj", "v_proj", "o_proj")
_llama_block = functools.partial(Family, attention=_QKVO, mlp=("gate_proj", "up_proj", "down_proj"))
_moe = functools.partial(Family, attention=_QKVO, mlp=(), router=("gate",))
_LLAMA_NAMES = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "olmo2": "OLMo 2"}
_GEMMA_NAMES = {"gemma": "Gemma", "gemma2": "Gemma 2", "gemma3_text": "Gemma 3 (text)", "gemma3": "Gemma 3"}
_MOE_NAMES = {"mixtral": "Mixtral", "qwen3_moe": "Qwen3-MoE", "olmoe": "OLMoE"}
#: ``config.json``'s ``model_type`` -> its block. A model type outside it is not guessed at.
FAMILIES: dict[str, Family] = {
    **{model_type: _llama_block(name) for model_type, name in (_LLAMA_NAMES | _GEMMA_NAMES).items()},
    "phi3": Family("Phi-3 / Phi-4-mini", ("qkv_proj", "o_proj"), ("gate_up_proj", "down_proj")),
    **{model_type: _moe(name) for model_type, name in _MOE_NAMES.items()},
}


def family(model_type: str | None) -> Family | None:
    """The block of ``model_type``, or None when the table does not know it."""
    return FAMILIES.get(model_type or "")


def resolve(targets: tuple[str, ...] | str, model_type: str | None) -> tuple[str, ...] | str:
    """The leaf names LoRA adapts for ``targets``: a keyword becomes the family's names (raising
    :class:`TargetsError` where it has none); anything else, as it is, is peft's."""
    block = family(model_type)
    if not isinstance(targets, str) or targets not in KEYWORDS or (block is None and targets == ALL_LINEAR):
        return targets
    if block is None:
        raise TargetsError(
            f"{targets!r} names layers by architecture, and model_type {model_type!r} is not in "
            f"the table ({', '.join(sorted(FAMILIES))})",
            "list the layer names instead",
        )
    if targets == ATTENTION:
        return block.attention
    if targets == MLP and not block.mlp:
        raise TargetsError(f"'mlp' on {block.name}: {_experts_why(block)}", "use attention")
    return block.mlp if targets == MLP else block.linear


def _experts_why(block: Family) -> str:
    return (
        f"{block.name}'s experts are fused 3D parameters in transformers 5, not Linear layers "
        "(bitsandbytes leaves them unquantized), so LoRA cannot adapt them by module name"
    )


def linear_leaves(tensor_names: Iterable[str], model_type: str | None) -> set[str]:
    """The leaf names of the Linear layers a checkpoint's tensors give the loaded model."""
    block = family(model_type)
    skip = {"lm_head", *(block.router if block else ())}
    return {
        leaf
        for leaf, in_experts in _weights(tensor_names)
        if not in_experts and leaf not in skip and "embed" not in leaf and "norm" not in leaf
    }


def expert_leaves(tensor_names: Iterable[str]) -> set[str]:
    """Leaf names that exist only inside MoE experts (``experts.N.w1`` -> ``w1``)."""
    return {leaf for leaf, in_experts in _weights(tensor_names) if in_experts}


def _weights(tensor_names: Iterable[str]) -> Iterator[tuple[str, bool]]:
    """``(leaf, inside MoE experts)`` of each ``...<leaf>.weight`` tensor name."""
    for name in tensor_names:
        parts = name.split(".")
        if len(parts) >= 2 and parts[-1] == "weight":
            yield parts[-2], "experts" in parts[:-2]


def check(
    targets: tuple[str, ...] | str, model_type: str | None, layers: set[str], experts: Iterable[str] = ()
) -> tuple[str, ...] | str:
    """``targets`` resolved; raises :class:`TargetsError` naming each name not in ``layers`` (one is
    enough: Llama names on Phi-3 would train a third of what was meant)."""
    resolved = resolve(targets, model_type)
    if isinstance(resolved, str):
        return resolved  # all-linear on an unknown block, or a regex: peft resolves it
    if not (missing := [name for name in resolved if name not in layers]):
        return resolved
    block, in_experts = family(model_type), set(experts)
    resolved_from = f"{targets!r} resolves to names of which " if isinstance(targets, str) else ""
    problem = f"{resolved_from}{', '.join(map(repr, missing))} match no layer of the model"
    fix = f"its layers are {', '.join(sorted(layers))}"
    inside = [name for name in missing if name in in_experts]
    if inside and block is not None and block.moe:
        problem += f" ({', '.join(inside)}: {_experts_why(block)})"
        fix += "; use attention"
    elif block is not None and set(block.linear) <= layers and not isinstance(targets, str):
        names = ", ".join(block.linear)
        fix += f"; {block.name} names its block {names} (target_modules: attention, mlp or all-linear)"
    raise TargetsError(problem, fix)
