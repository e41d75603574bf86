"""Activation offload through its real hooks on a tiny Llama on the CPU: what goes to the host with
and without checkpointing, host buffers reused between micro-steps, and given back on release.

On the CPU nothing is an accelerator tensor, so :func:`activations.offloads` is widened to the
CPU's activations here (same rule otherwise: parameters, their views and tiny tensors stay); the
pool then copies them to unpinned host buffers. What only a GPU shows: the buffers are pinned
(the host caching allocator rounds each to a power of two, which the host model counts), and the
RSS falls when :func:`release_host_buffers` empties that allocator's cache
(bench/scenarios/host_memory.py measures both on the H200).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from qlora_supervise.policies.memory.host import offloaded_bytes
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.trainer_child.contract.spec import Knobs

# torch, transformers and the recipe are imported by the tests that run, not at collection: every
# xdist worker collects every module, and these imports cost seconds each time.
if TYPE_CHECKING:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from qlora_supervise.trainer_child.recipe import activations

LAYERS, HIDDEN, INTERMEDIATE, BATCH, SEQ = 3, 64, 160, 2, 32


@functools.cache
def _config() -> LlamaConfig:
    from transformers import LlamaConfig

    return LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=128,
    )


OFFLOAD = Knobs(model="m", activation_offload=True, micro_batch_size=BATCH, max_seq_len=SEQ)


def _cpu_offloads(tensor: torch.Tensor) -> bool:
    """offloads() with the CPU standing in for the accelerator."""
    import torch

    from qlora_supervise.trainer_child.recipe import activations

    if isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter):
        return False
    return tensor.numel() * tensor.element_size() >= activations.MIN_OFFLOAD_BYTES


@pytest.fixture(name="pool")
def pool_fixture(monkeypatch: pytest.MonkeyPatch) -> Iterator[activations.HostBuffers]:
    """A fresh process pool (unpinned), the CPU's activations offloadable, every copy's shape kept."""
    from qlora_supervise.trainer_child.recipe import activations

    monkeypatch.setattr(activations, "offloads", _cpu_offloads)
    pool = activations.HostBuffers(pin_memory=False)
    monkeypatch.setattr(activations, "_POOL", pool)
    pool.shapes = []  # type: ignore[attr-defined]
    take = pool.take

    def recording(tensor: torch.Tensor) -> torch.Tensor:
        pool.shapes.append(tuple(tensor.shape))  # type: ignore[attr-defined]
        return take(tensor)

    monkeypatch.setattr(pool, "take", recording)
    yield pool


def _model(checkpointing: bool) -> LlamaForCausalLM:
    """A frozen base whose input embeddings require grad, as prepare_model_for_kbit_training leaves it."""
    import torch
    from transformers import LlamaForCausalLM

    from qlora_supervise.trainer_child.recipe import activations

    torch.manual_seed(0)
    model = LlamaForCausalLM(_config())
    model.requires_grad_(False)
    model.enable_input_require_grads()
    for layer in model.model.layers:  # a stand-in adapter: something to train in every block
        layer.self_attn.q_proj.weight.requires_grad_(True)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=activations.checkpointing_kwargs())
    model.train()
    return model


def _micro_step(
    model: LlamaForCausalLM, pool: activations.HostBuffers, batch: int = BATCH, seq: int = SEQ
) -> int:
    """One forward+backward under offload; the host bytes held at the end of the forward."""
    import torch

    from qlora_supervise.trainer_child.recipe import activations

    ids = torch.randint(0, _config().vocab_size, (batch, seq))
    with activations.activation_context(OFFLOAD):
        loss = model(input_ids=ids, labels=ids).loss
        held = pool.in_use_bytes
        loss.backward()
    return held


def test_with_checkpointing_only_the_block_inputs_and_the_heads_go_to_the_host(
    pool: activations.HostBuffers,
) -> None:
    """With checkpointing the host gets each block's hidden-wide input (and the final norm's and the
    head's), no block intermediate, and as many bytes as the host model counts; without it every
    block's intermediates go too (the MLP's wide ones among them), several times the bytes."""
    import torch

    held = _micro_step(_model(checkpointing=True), pool)
    shapes = pool.shapes  # type: ignore[attr-defined]
    tokens = BATCH * SEQ
    assert all(INTERMEDIATE not in shape for shape in shapes), shapes
    hidden_wide = [s for s in shapes if torch.Size(s).numel() == tokens * HIDDEN]
    assert len(hidden_wide) >= LAYERS
    shape = ModelShape.from_config({**_config().to_dict(), "model_type": "llama"})
    predicted = offloaded_bytes(shape, dataclasses.replace(OFFLOAD, gradient_checkpointing=True), pin=False)
    # The model counts trl's fused head, which keeps its gathered fp32 input; transformers' own head
    # with a frozen weight keeps none (its input gradient needs the weight only): one tensor less.
    assert sum(torch.Size(s).numel() * 4 for s in hidden_wide) == predicted - tokens * HIDDEN * 4
    pool.shapes.clear()  # type: ignore[attr-defined]
    held_without = _micro_step(_model(checkpointing=False), pool)
    assert any(INTERMEDIATE in s for s in pool.shapes), pool.shapes  # type: ignore[attr-defined]
    assert held_without > 4 * held


def test_a_tensor_saved_while_the_backward_runs_stays_where_it_is(pool: activations.HostBuffers) -> None:
    """A reentrant checkpoint recomputes its block inside the backward under the offload hooks: what
    that recomputation saves is read back in the same backward, so nothing of it is copied out."""
    import torch

    from qlora_supervise.trainer_child.recipe import activations

    block = torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, INTERMEDIATE), torch.nn.GELU(), torch.nn.Linear(INTERMEDIATE, HIDDEN)
    )
    x = torch.randn(BATCH * SEQ, HIDDEN, requires_grad=True)
    with activations.activation_context(OFFLOAD):
        out = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
        forward = pool.packed
        out.sum().backward()
    assert forward >= 1 and pool.packed == forward
    assert x.grad is not None


def test_host_buffers_are_reused_between_micro_steps_and_freed_after_each_backward(
    pool: activations.HostBuffers,
) -> None:
    """The first micro-step allocates the buffers, the next ones copy into the same ones (no new
    allocation, held bytes flat), and each backward hands all of them back to the pool."""
    model = _model(checkpointing=True)
    _micro_step(model, pool)
    allocated, held, packed = pool.allocated, pool.held_bytes, pool.packed
    assert allocated == packed > 0 and pool.in_use_bytes == 0
    for _ in range(2):
        _micro_step(model, pool)
        assert pool.in_use_bytes == 0
    assert pool.allocated == allocated and pool.held_bytes == held
    assert pool.reused == 2 * packed
    assert pool.peak_in_use_bytes == held


def test_release_gives_the_buffers_back_and_a_new_config_allocates_its_own(
    pool: activations.HostBuffers,
) -> None:
    """release_host_buffers() (after the speed trial, or when the micro-batch or checkpointing changes
    in-process) drops every free buffer; the next config's micro-step allocates what it needs."""
    from qlora_supervise.trainer_child.recipe import activations

    model = _model(checkpointing=True)
    _micro_step(model, pool)
    held = pool.held_bytes
    assert activations.release_host_buffers() == held > 0
    assert pool.held_bytes == 0
    _micro_step(model, pool, batch=2 * BATCH)
    assert pool.held_bytes >= 2 * held and pool.allocated > 0  # twice the tokens, and what then passes 1 KiB


def test_buffers_stay_bounded_when_each_micro_step_pads_to_another_length(
    pool: activations.HostBuffers,
) -> None:
    """30 micro-steps padded to 30 different lengths (trl's collator pads each batch to its longest
    row): buffers of a size rounded up to a power of two are reused across lengths, so the pool
    holds less than twice its peak in use, and the gradients match a run without offload."""
    import torch

    from qlora_supervise.trainer_child.recipe import activations

    model = _model(checkpointing=True)
    lengths = [17 + (7 * i) % 48 for i in range(30)]  # 30 lengths between 17 and 64 tokens
    assert len(set(lengths)) == 30
    for seq in lengths:
        _micro_step(model, pool, seq=seq)
        assert pool.in_use_bytes == 0
    assert pool.held_bytes <= 2 * pool.peak_in_use_bytes, (pool.held_bytes, pool.peak_in_use_bytes)
    assert pool.reused > pool.allocated
    ids = torch.randint(0, _config().vocab_size, (BATCH, 40))
    grads = []
    for offload in (True, False):
        model.zero_grad()
        with activations.activation_context(dataclasses.replace(OFFLOAD, activation_offload=offload)):
            model(input_ids=ids, labels=ids).loss.backward()
        grads.append(model.model.layers[0].self_attn.q_proj.weight.grad.clone())
    assert torch.allclose(grads[0], grads[1])


def test_the_same_tensor_saved_twice_is_copied_once(pool: activations.HostBuffers) -> None:
    """A tensor two ops save (x * x saves x twice) takes one host buffer; the gradient is still right."""
    import torch

    from qlora_supervise.trainer_child.recipe import activations

    x = torch.randn(BATCH * SEQ, HIDDEN, requires_grad=True)
    with activations.activation_context(OFFLOAD):
        y = x * 1.0  # an activation (not a leaf): what a block passes on
        (y * y).sum().backward()
    assert pool.packed == 1
    assert torch.allclose(x.grad, 2 * x.detach())  # type: ignore[arg-type]
