"""The memory model: its terms, its typed refusals, recorded H200 points, and calibration."""

from __future__ import annotations

import dataclasses
import json
import statistics
from pathlib import Path
from typing import Any, get_args

import pytest

from qlora_supervise.policies import memory_model
from qlora_supervise.policies.memory import gpu
from qlora_supervise.policies.memory.shape import ModelShape, Unsupported, UnsupportedReason
from qlora_supervise.supervisor.jobfile.schema import Optimizer
from qlora_supervise.trainer_child.contract.spec import Knobs

FIXTURE = json.loads((Path(__file__).parent / "fixtures" / "memory_points_h200.json").read_text())
SHAPES = {name: ModelShape(**fields) for name, fields in FIXTURE["shapes"].items()}
SHAPE_7B = SHAPES["7b-32k"]
LLAMA3_8B = ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
LLAMA32_1B = dataclasses.replace(
    LLAMA3_8B, hidden=2048, layers=16, intermediate=8192, tie_word_embeddings=True
)
#: Issue 8's targets on peak allocated: every point within 15 %, the median within 5 %.
WORST_TARGET, MEDIAN_TARGET = 0.15, 0.05


def knobs(**fields: Any) -> Knobs:
    # Checkpointing off unless asked: the points and comparisons start from the ambitious config.
    return Knobs(model="/m", eval_enabled=False, **{"gradient_checkpointing": False, **fields})


def targets_of(point: dict[str, Any]) -> tuple[str, ...] | str:
    raw = point["targets"]
    return raw if isinstance(raw, str) else tuple(raw)


def point_error(point: dict[str, Any]) -> float:
    """(predicted - measured) / measured for one recorded point."""
    shape = SHAPES[point["shape"]]
    predicted = memory_model.predict(shape, knobs(**point["knobs"]), targets_of(point)).peak_bytes
    measured: int = point["peak_allocated"]
    return (predicted - measured) / measured


def test_fixture_covers_what_the_model_distinguishes() -> None:
    """The recorded points span every shape, checkpointing on and off, accumulation and each optimizer."""
    points = FIXTURE["points"]
    assert {p["shape"] for p in points} == set(SHAPES)
    assert {p["knobs"]["gradient_checkpointing"] for p in points} == {True, False}
    assert {p["knobs"]["optimizer"] for p in points} >= set(get_args(Optimizer)) - {"adamw_torch_fused"}
    assert any(p["knobs"]["grad_accum"] > 1 for p in points)
    assert max(p["knobs"]["lora_r"] for p in points if p["targets"] == "all-linear") >= 256


@pytest.mark.parametrize("point", FIXTURE["points"], ids=lambda p: p["what"][:48])
def test_recorded_h200_points_within_fifteen_percent(point: dict[str, Any]) -> None:
    """Each recorded peak of our recipe on the H200 is predicted within 15 % (issue 8's worst case)."""
    assert abs(point_error(point)) <= WORST_TARGET


@pytest.mark.parametrize(
    "point", [p for p in FIXTURE["points"] if p.get("before_grid")], ids=lambda p: p["what"][:40]
)
def test_recorded_h200_points_within_five_percent(point: dict[str, Any]) -> None:
    """Each peak recorded before the grid (the 7B ladder runs) is predicted within 5 %."""
    assert abs(point_error(point)) < 0.05


def test_recorded_h200_points_median_within_five_percent() -> None:
    """Over all recorded H200 points the median |error| is at most 5 %."""
    assert statistics.median(abs(point_error(p)) for p in FIXTURE["points"]) <= MEDIAN_TARGET


def test_prediction_is_above_an_oom_lower_bound() -> None:
    """A config that died needing more than N bytes is predicted above N."""
    bound = FIXTURE["lower_bounds"][0]
    assert memory_model.predict(SHAPE_7B, knobs(**bound["knobs"])).peak_bytes > bound["allocated_at_oom"]


def test_four_bit_weights_match_the_measured_load() -> None:
    """NF4 with double quant plus bf16 embeddings is what the H200 held after loading the 7B."""
    static = gpu.static_components(SHAPE_7B, knobs())
    before_prepare = static["weights_4bit"] + (static["embeddings_fp32"] + static["lm_head_fp32"]) // 2
    measured = FIXTURE["after_load_4bit_bf16_embeddings"]
    assert abs(before_prepare - measured) / measured < 0.01
    assert gpu.NF4_DOUBLE_QUANT < gpu.NF4_SINGLE_QUANT


def test_components_sum_to_the_peak() -> None:
    """The components of a prediction add up to its peak; reserved and card bytes exceed it."""
    p = memory_model.predict(LLAMA3_8B, knobs(micro_batch_size=2, max_seq_len=4096))
    assert sum(p.components.values()) == p.peak_bytes
    assert p.peak_bytes < p.reserved_bytes < p.card_bytes


def test_tied_embeddings_count_once_and_are_fp32() -> None:
    """A tied 128k head is one fp32 matrix; untied it is two (prepare_model_for_kbit_training upcasts)."""
    tied = gpu.static_components(LLAMA32_1B, knobs())
    untied = gpu.static_components(dataclasses.replace(LLAMA32_1B, tie_word_embeddings=False), knobs())
    assert tied["embeddings_fp32"] == 128256 * 2048 * 4
    assert tied["lm_head_fp32"] == 0 and untied["lm_head_fp32"] == tied["embeddings_fp32"]


def test_grouped_query_attention_shrinks_activations() -> None:
    """Fewer kv heads: smaller k/v activations and adapters, so a smaller peak at the same tokens."""
    mha = dataclasses.replace(LLAMA3_8B, kv_heads=32)
    k = knobs(micro_batch_size=1, max_seq_len=4096)
    assert memory_model.predict(LLAMA3_8B, k).peak_bytes < memory_model.predict(mha, k).peak_bytes


def test_optimizers_by_kind() -> None:
    """torch AdamW keeps two moments in the adapter's bf16 (plus a foreach temporary), bitsandbytes
    8-bit two bytes plus absmax, 32-bit paged eight bytes outside the allocator."""
    n = gpu.lora_params(SHAPE_7B, 64, "all-linear")
    optimizers = get_args(Optimizer)
    state = {o: gpu.adapter_bytes(SHAPE_7B, knobs(optimizer=o, lora_r=64), "all-linear") for o in optimizers}
    assert state["adamw_torch"].state == 4 * n and state["adamw_torch"].step_temp == 2 * n
    assert state["adamw_torch_fused"].state == 4 * n and state["adamw_torch_fused"].step_temp == 0
    assert 2 * n < state["adamw_8bit"].state < 2.05 * n
    assert state["paged_adamw_32bit"].state == 0 and state["paged_adamw_32bit"].paged == 8 * n
    assert state["adamw_torch"].grads == 2 * n  # the gradient has the parameter's dtype
    paged = memory_model.predict(SHAPE_7B, knobs(optimizer="paged_adamw_32bit", lora_r=64))
    assert paged.outside["paged_optimizer_state"] > 0


def test_small_tensors_of_a_paged_optimizer_stay_in_the_allocator() -> None:
    """bitsandbytes pages only tensors of 1e5 elements or more: rank 8 on 4096-wide layers is not paged."""
    small = gpu.adapter_bytes(SHAPE_7B, knobs(optimizer="paged_adamw_8bit", lora_r=8), gpu.DEFAULT_TARGETS)
    large = gpu.adapter_bytes(SHAPE_7B, knobs(optimizer="paged_adamw_8bit", lora_r=32), gpu.DEFAULT_TARGETS)
    assert small.paged == 0 and small.state > 2 * gpu.lora_params(SHAPE_7B, 8, gpu.DEFAULT_TARGETS)
    assert large.state == 0 and large.paged > 0


def test_adapter_is_bf16_on_the_four_bit_path_and_fp32_without_it() -> None:
    """trl casts a quantized model's adapter to bf16; unquantized, peft's fp32 adapter stays."""
    n = gpu.lora_params(SHAPE_7B, 16, gpu.DEFAULT_TARGETS)
    assert gpu.static_components(SHAPE_7B, knobs(lora_r=16))["lora_params"] == 2 * n
    assert gpu.static_components(SHAPE_7B, knobs(lora_r=16, load_in_4bit=False))["lora_params"] == 4 * n


def test_gradients_are_in_the_backward_only_when_accumulating() -> None:
    """The Trainer zeroes gradients to None after each step: a step's first backward starts without them."""
    big = knobs(lora_r=256, max_seq_len=2048, micro_batch_size=2, grad_accum=1, gradient_checkpointing=True)
    one = memory_model.predict(SHAPE_7B, big, "all-linear")
    accumulating = memory_model.predict(SHAPE_7B, dataclasses.replace(big, grad_accum=4), "all-linear")
    assert one.phase == "backward" and "lora_grads" not in one.components
    assert accumulating.peak_bytes - one.peak_bytes == 2 * gpu.lora_params(SHAPE_7B, 256, "all-linear")


def test_short_jobs_on_a_big_vocabulary_peak_at_load() -> None:
    """Casting an untied 128k head to fp32 holds its bf16 original too: that is the peak of a short job."""
    p = memory_model.predict(LLAMA3_8B, knobs(max_seq_len=512, gradient_checkpointing=True))
    assert p.phase == "load" and p.components["load_cast_16bit"] == 128256 * 4096 * 2


def test_lm_head_backward_holds_two_head_slices_when_the_vocabulary_has_several() -> None:
    """trl's backward binds the next bf16 slice of the head before dropping the previous one."""
    big = gpu.loss_components(LLAMA3_8B, 1, 512)["loss_tiles"]
    small = gpu.loss_components(dataclasses.replace(LLAMA3_8B, vocab=32000), 1, 512)["loss_tiles"]
    slice_bytes = gpu.HEAD_VOCAB_TILE * 4096 * 2
    assert big >= 2 * slice_bytes and small < slice_bytes + 511 * (32000 + 4096) * 2 + 1


def test_checkpointing_micro_batch_and_seq_len_lower_the_peak() -> None:
    """Each throughput or quality knob the ladder turns lowers the prediction."""
    base = knobs(micro_batch_size=4, max_seq_len=4096)
    peak = memory_model.predict(LLAMA3_8B, base).peak_bytes
    for change in ({"gradient_checkpointing": True}, {"micro_batch_size": 2}, {"max_seq_len": 2048}):
        assert memory_model.predict(LLAMA3_8B, dataclasses.replace(base, **change)).peak_bytes < peak


@pytest.mark.parametrize(
    ("config", "reason"),
    [
        ({"architectures": ["FalconForCausalLM"], "hidden_size": 4096}, UnsupportedReason.NOT_MODELLED),
        (
            {"architectures": ["LlamaForCausalLM"], "num_local_experts": 8, "hidden_size": 1},
            UnsupportedReason.MIXTURE_OF_EXPERTS,
        ),
        ({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}, UnsupportedReason.MISSING_FIELD),
        (
            {"hidden_size": "big", "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 9},
            UnsupportedReason.BAD_VALUE,
        ),
    ],
)
def test_configs_outside_the_model_are_refused_with_a_reason(
    config: dict[str, Any], reason: UnsupportedReason
) -> None:
    """Experts on a dense block, unmodelled blocks and broken configs get a typed reason, not a number."""
    read = ModelShape.read(config)
    assert isinstance(read, Unsupported) and read.reason is reason and read.detail
    assert ModelShape.from_config(config) is None


def test_llama_config_is_read_with_tie_and_gqa() -> None:
    """A Llama-3.2-1B-style config.json gives its shape, tie flag and kv heads."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
        "vocab_size": 128256,
        "tie_word_embeddings": True,
        "head_dim": 64,
    }
    assert ModelShape.read(config) == dataclasses.replace(LLAMA32_1B, head_dim=64)


def _truth(monkeypatch: pytest.MonkeyPatch, shape: ModelShape, k: Knobs, factor: float) -> int:
    """A 'real' peak the model gets wrong: every block keeps ``factor`` times the modelled bytes."""
    original = gpu.layer_activation_bytes
    with monkeypatch.context() as m:
        m.setattr(gpu, "layer_activation_bytes", lambda *a, **kw: int(original(*a, **kw) * factor))
        m.setattr(gpu, "BACKWARD_TRANSIENT_I", gpu.BACKWARD_TRANSIENT_I * factor)
        return memory_model.predict(shape, k).peak_bytes


@pytest.mark.parametrize("factor", [0.7, 1.3, 1.6])
def test_calibration_brings_nearby_configs_within_three_percent(
    monkeypatch: pytest.MonkeyPatch, factor: float
) -> None:
    """One observed peak corrects the next prediction for a nearby config to within 3 %."""
    observed = knobs(micro_batch_size=2, max_seq_len=2048, gradient_checkpointing=False)
    seen = memory_model.Observation(observed, _truth(monkeypatch, LLAMA3_8B, observed, factor))
    scale = memory_model.calibrate(LLAMA3_8B, [seen])
    assert scale is not None
    for nearby in (
        dataclasses.replace(observed, micro_batch_size=1, grad_accum=32),
        dataclasses.replace(observed, max_seq_len=4096),
        dataclasses.replace(observed, micro_batch_size=4, max_seq_len=1024),
    ):
        truth = _truth(monkeypatch, LLAMA3_8B, nearby, factor)
        raw = memory_model.estimate_peak(LLAMA3_8B, nearby)
        calibrated = memory_model.estimate_peak(LLAMA3_8B, nearby, scale)
        assert abs(calibrated - truth) / truth < 0.03
        assert abs(calibrated - truth) < abs(raw - truth)


def test_calibration_ignores_ooms_and_needs_data() -> None:
    """An OOM's bytes are a lower bound, not a peak: alone they do not calibrate."""
    oom = memory_model.Observation(knobs(), 10**10, exceeded=True)
    assert memory_model.calibrate(SHAPE_7B, []) is None
    assert memory_model.calibrate(SHAPE_7B, [oom]) is None
