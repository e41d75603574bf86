"""The bf16 head keeps the embeddings and LM head in the compute dtype through k-bit prepare (norms
upcast, no fp32 copy made), tied or not; activation offload moves activations, never parameters."""

from __future__ import annotations

from typing import Any

import pytest

from qlora_supervise.trainer_child.contract.spec import AttemptSpec, DataSpec, Knobs, TrainSpec

# torch is imported by the tests that run, not at collection: every xdist worker collects every module.


def _model(tied: bool) -> Any:
    """A small Llama in bf16, as the recipe loads the non-4-bit weights in the compute dtype."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        tie_word_embeddings=tied,
    )
    return LlamaForCausalLM(config).to(torch.bfloat16)


def _prepared(bf16_head: bool, tied: bool = False) -> Any:
    import torch

    from qlora_supervise.trainer_child.recipe.qlora import add_lora

    knobs = Knobs(model="m", gradient_checkpointing=False, bf16_head=bf16_head)
    spec = AttemptSpec(1, "/run", knobs, DataSpec("/d.jsonl"), TrainSpec(), "e", "f", "c", "a", "m")
    return add_lora(_model(tied), knobs, spec, torch.bfloat16)


def _dtypes(model: Any) -> tuple[Any, Any, set[Any]]:
    base = model.get_base_model()
    norms = {p.dtype for name, p in base.named_parameters() if "norm" in name}
    return base.get_input_embeddings().weight.dtype, base.get_output_embeddings().weight.dtype, norms


def test_the_usual_prepare_upcasts_the_head_and_the_knob_keeps_it() -> None:
    """Without the knob the embeddings and head are fp32 after prepare; with it bf16; norms fp32 both ways."""
    import torch

    assert _dtypes(_prepared(bf16_head=False)) == (torch.float32, torch.float32, {torch.float32})
    assert _dtypes(_prepared(bf16_head=True)) == (torch.bfloat16, torch.bfloat16, {torch.float32})


def test_the_kept_weights_are_the_loaded_ones_not_a_round_trip() -> None:
    """The head keeps its own storage through prepare (no fp32 copy was ever made of it)."""
    import torch
    from peft import prepare_model_for_kbit_training

    from qlora_supervise.trainer_child.recipe.head import head_parameters, kept_out_of_upcast

    model = _model(tied=False)
    kept = head_parameters(model)
    pointers = [p.data_ptr() for p in kept]
    with kept_out_of_upcast(kept, torch.bfloat16):
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    assert [p.data_ptr() for p in kept] == pointers
    assert model.model.norm.weight.dtype == torch.float32


def test_a_tied_head_stays_tied_and_bf16() -> None:
    """A tied head is one parameter with the embeddings: kept once, still shared, in bf16."""
    import torch

    model = _prepared(bf16_head=True, tied=True).get_base_model()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.get_output_embeddings().weight.dtype == torch.bfloat16


def test_a_plain_forward_without_autocast_trains_through_a_bf16_head() -> None:
    """The fp32 norm's output meets the bf16 head in its dtype: the loss is finite and backward runs,
    and it is the upcast model's loss to bf16 precision."""
    import torch

    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for bf16_head in (False, True):
        model = _prepared(bf16_head=bf16_head)
        model.train()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert loss.dtype == torch.float32 and torch.isfinite(loss)
        losses.append(float(loss.detach()))
    assert losses[1] == pytest.approx(losses[0], rel=2e-2)


def test_activation_offload_moves_activations_only() -> None:
    """offloads(): an activation on an accelerator goes to the host; parameters, host tensors and
    tiny tensors stay (meta tensors stand in for a device here)."""
    import torch

    from qlora_supervise.trainer_child.recipe.activations import MIN_OFFLOAD_BYTES, offloads

    activation = torch.empty(MIN_OFFLOAD_BYTES, dtype=torch.uint8, device="meta")
    assert offloads(activation)
    assert not offloads(torch.nn.Parameter(torch.empty(MIN_OFFLOAD_BYTES, device="meta")))
    assert not offloads(torch.empty(MIN_OFFLOAD_BYTES, dtype=torch.uint8))
    assert not offloads(torch.empty(8, dtype=torch.uint8, device="meta"))


def test_a_micro_step_under_activation_offload_saves_through_its_hooks(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the knob on, every tensor autograd saves in the micro-step is put to offloads(); off, none."""
    import torch

    from qlora_supervise.trainer_child.recipe import activations

    asked: list[Any] = []
    monkeypatch.setattr(activations, "offloads", lambda tensor: asked.append(tensor) or False)
    weight = torch.nn.Parameter(torch.randn(4, 4))
    for knob in (False, True):
        with activations.activation_context(Knobs(model="m", activation_offload=knob)):
            (torch.tanh(torch.randn(2, 4) @ weight)).sum().backward()
        assert bool(asked) is knob
    assert weight.grad is not None
