"""LoRA targets by model type (issue 20, item 2): the table both processes use, and ``validate``
refusing names that match nothing, or only part of what was meant, from the safetensors headers."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from qlora_supervise.policies.memory.shape import resolve_targets
from qlora_supervise.supervisor.jobfile import JobError, load_job
from qlora_supervise.trainer_child.contract.targets import (
    TargetsError,
    check,
    expert_leaves,
    linear_leaves,
    resolve,
)

LLAMA_BLOCK = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
QKVO = LLAMA_BLOCK[:4]


def block_names(model_type: str) -> list[str]:
    """The tensor names of a one-layer checkpoint of ``model_type``, as its safetensors header has them."""
    top = [
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
        "model.layers.0.input_layernorm.weight",
    ]
    attention = [f"model.layers.0.self_attn.{n}.weight" for n in QKVO]
    if model_type == "phi3":
        fused = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]
        return top + [f"model.layers.0.{n}.weight" for n in fused]
    if model_type == "qwen3_moe":
        experts = [f"model.layers.0.mlp.experts.{e}.{n}.weight" for e in range(2) for n in LLAMA_BLOCK[4:]]
        return (
            top
            + attention
            + experts
            + ["model.layers.0.mlp.gate.weight", "model.layers.0.self_attn.q_norm.weight"]
        )
    if model_type == "mixtral":
        experts = [
            f"model.layers.0.block_sparse_moe.experts.{e}.w{i}.weight" for e in range(2) for i in (1, 2, 3)
        ]
        return top + attention + experts + ["model.layers.0.block_sparse_moe.gate.weight"]
    return top + attention + [f"model.layers.0.mlp.{n}.weight" for n in LLAMA_BLOCK[4:]]


@pytest.mark.parametrize(
    ("targets", "model_type", "expected"),
    [
        ("attention", "llama", QKVO),
        ("mlp", "gemma2", LLAMA_BLOCK[4:]),
        ("all-linear", "qwen3", LLAMA_BLOCK),
        ("attention", "phi3", ("qkv_proj", "o_proj")),
        ("mlp", "phi3", ("gate_up_proj", "down_proj")),
        ("all-linear", "qwen3_moe", QKVO),  # the experts are no Linear layers in transformers 5
        ("all-linear", "mixtral", QKVO),
        ("all-linear", "falcon", "all-linear"),  # outside the table: peft's own rule
        (("q_proj", "v_proj"), "phi3", ("q_proj", "v_proj")),  # a list stays a list (check() judges it)
    ],
)
def test_keywords_resolve_to_each_familys_own_layer_names(
    targets: tuple[str, ...] | str, model_type: str, expected: tuple[str, ...] | str
) -> None:
    """attention / mlp / all-linear name the family's layers: Phi-3's fused ones, a MoE's attention."""
    assert resolve(targets, model_type) == expected


@pytest.mark.parametrize(
    ("targets", "model_type", "words"),
    [
        ("mlp", "qwen3_moe", ("fused 3D parameters", "use attention")),
        ("mlp", "olmoe", ("not Linear layers", "unquantized")),
        ("attention", "falcon", ("'falcon'", "list the layer names")),
    ],
)
def test_keywords_that_cannot_resolve_are_errors_that_say_why(
    targets: str, model_type: str, words: tuple[str, ...]
) -> None:
    """mlp on a mixture of experts, or a keyword on a model type outside the table, raise with the reason."""
    with pytest.raises(TargetsError) as caught:
        resolve(targets, model_type)
    for word in words:
        assert word in str(caught.value)


def test_checkpoint_names_become_the_loaded_models_linear_layers() -> None:
    """Norms, embeddings, the head, MoE experts and the router are no Linear layers LoRA can target."""
    assert linear_leaves(block_names("llama"), "llama") == set(LLAMA_BLOCK)
    assert linear_leaves(block_names("qwen3_moe"), "qwen3_moe") == set(QKVO)
    assert linear_leaves(block_names("mixtral"), "mixtral") == set(QKVO)
    assert expert_leaves(block_names("mixtral")) == {"w1", "w2", "w3"}


def test_llama_names_on_phi3_are_an_error_though_two_of_them_match() -> None:
    """o_proj and down_proj exist on Phi-3; q/k/v/gate/up do not: an error naming the fused layers."""
    layers = linear_leaves(block_names("phi3"), "phi3")
    with pytest.raises(TargetsError) as caught:
        check(LLAMA_BLOCK, "phi3", layers)
    error = caught.value
    assert "'q_proj', 'k_proj', 'v_proj', 'gate_proj', 'up_proj' match no layer" in error.problem
    assert "qkv_proj" in error.fix and "gate_up_proj" in error.fix and "attention" in error.fix
    assert check("attention", "phi3", layers) == ("qkv_proj", "o_proj")


def test_expert_names_on_a_moe_say_the_experts_are_fused() -> None:
    """gate_proj is in a Qwen3-MoE checkpoint, but only inside experts: the error says why it is no layer."""
    names = block_names("qwen3_moe")
    with pytest.raises(TargetsError) as caught:
        check(("q_proj", "gate_proj"), "qwen3_moe", linear_leaves(names, "qwen3_moe"), expert_leaves(names))
    assert "'gate_proj' match no layer" in caught.value.problem and "fused 3D" in caught.value.problem


def test_the_memory_model_reads_keywords_as_the_llama_block() -> None:
    """The planner's resolve_targets gives attention / mlp their Llama names (before: nothing matched)."""
    assert resolve_targets("attention") == QKVO
    assert resolve_targets("mlp") == LLAMA_BLOCK[4:]
    assert resolve_targets("all-linear") == LLAMA_BLOCK


# --------------------------------------------------------------------------- validate


def model_dir(root: Path, model_type: str, names: list[str] | None = None) -> Path:
    """A model directory with config.json and a safetensors header (no weights) of ``model_type``."""
    model = root / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"model_type": model_type, "hidden_size": 8}))
    header = {
        n: {"dtype": "F32", "shape": [8, 8], "data_offsets": [0, 0]} for n in names or block_names(model_type)
    }
    raw = json.dumps(header).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    (root / "data.jsonl").write_text("".join(json.dumps({"text": f"row {i}"}) + "\n" for i in range(5)))
    return model


def job(root: Path, targets: str) -> Path:
    path = root / "job.yaml"
    path.write_text(
        f"model: {{path: ./model}}\ndata: {{path: ./data.jsonl}}\nlora: {{target_modules: {targets}}}\n"
    )
    return path


def target_problem(path: Path) -> str:
    """The rendered lora.target_modules problem of the job at ``path`` (the test fails without one)."""
    with pytest.raises(JobError) as caught:
        load_job(path)
    return next(p.render() for p in caught.value.problems if p.path == "lora.target_modules")


def test_validate_refuses_llama_names_on_phi3_naming_its_layers(tmp_path: Path) -> None:
    """[q_proj, k_proj, v_proj, o_proj] on a Phi-3 header: a problem naming qkv_proj, before any child."""
    model_dir(tmp_path, "phi3")
    text = target_problem(job(tmp_path, "[q_proj, k_proj, v_proj, o_proj]"))
    assert "'q_proj', 'k_proj', 'v_proj' match no layer" in text and "qkv_proj" in text


def test_validate_accepts_keywords_that_resolve_on_the_models_header(tmp_path: Path) -> None:
    """attention on Phi-3 and all-linear on Qwen3-MoE pass; the job keeps the keyword for the child."""
    model_dir(tmp_path / "phi", "phi3")
    assert load_job(job(tmp_path / "phi", "attention")).train.target_modules == "attention"
    model_dir(tmp_path / "moe", "qwen3_moe")
    assert load_job(job(tmp_path / "moe", "all-linear")).train.target_modules == "all-linear"


@pytest.mark.parametrize(
    ("model_type", "targets", "words"),
    [
        ("qwen3_moe", "mlp", ("fused 3D parameters", "use attention")),
        ("qwen3_moe", "[q_proj, gate_proj]", ("'gate_proj' match no layer", "fused 3D")),
        ("mixtral", "[q_proj, w1]", ("'w1' match no layer", "Mixtral's experts")),
        ("falcon", "attention", ("'falcon'", "list the layer names")),
    ],
)
def test_validate_refuses_targets_a_moe_or_an_unknown_type_cannot_take(
    tmp_path: Path, model_type: str, targets: str, words: tuple[str, ...]
) -> None:
    """Expert names, mlp on a MoE and keywords on a model type outside the table are problems at validate."""
    model_dir(tmp_path, model_type, block_names("llama") if model_type == "falcon" else None)
    text = target_problem(job(tmp_path, targets))
    for word in words:
        assert word in text, text


def test_validate_resolves_a_keyword_without_names_to_check(tmp_path: Path) -> None:
    """With no readable names (a .bin checkpoint) a keyword still resolves: mlp passes on llama, not a MoE."""
    model = model_dir(tmp_path, "llama")
    (model / "model.safetensors").unlink()
    (model / "pytorch_model.bin").write_bytes(b"\0" * 16)
    assert load_job(job(tmp_path, "mlp")).train.target_modules == "mlp"
    (model / "config.json").write_text(json.dumps({"model_type": "olmoe"}))
    assert "fused 3D parameters" in target_problem(job(tmp_path, "mlp"))
