"""Pre-flight: start as written when it fits, else the cheapest throughput change, quality last."""

from __future__ import annotations

import dataclasses

from qlora_supervise.policies import memory_model
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.policies.rungs import CostClass
from qlora_supervise.policies.search import throughput
from qlora_supervise.policies.search.config_search import preflight
from qlora_supervise.policies.search.search_state import rung_effects
from qlora_supervise.trainer_child.contract.spec import Knobs

GiB = 1 << 30
SHAPE_7B = ModelShape(hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008, vocab=32000)
SHAPE_1B = ModelShape(
    hidden=2048, layers=16, heads=32, kv_heads=8, intermediate=8192, vocab=128256, tie_word_embeddings=True
)
AMBITIOUS = Knobs(
    model="/m",
    micro_batch_size=4,
    grad_accum=4,
    max_seq_len=2048,
    eval_enabled=False,
    gradient_checkpointing=False,
)
QUALITY = ("max_seq_len", "lora_r", "lora_alpha", "model")


def test_a_job_that_fits_starts_as_written() -> None:
    """Predicted to fit with the margin: no change at all."""
    result = preflight(SHAPE_7B, AMBITIOUS, 120 * GiB)
    assert result.fits_as_written and result.knobs == AMBITIOUS and not result.changes


def test_throughput_changes_only_while_one_fits() -> None:
    """On 8 to 24 GiB cards the 7B job fits by throughput knobs alone: seq_len and rank stay."""
    for cap in (8, 12, 16, 24):
        result = preflight(SHAPE_7B, AMBITIOUS, cap * GiB)
        assert result.fits and not result.quality_changed
        assert not set(result.changes) & set(QUALITY)
        assert result.knobs.effective_batch == AMBITIOUS.effective_batch
        assert memory_model.estimate_peak(SHAPE_7B, result.knobs) <= cap * GiB / 1.08


def test_rungs_are_combined_when_one_alone_does_not_fit() -> None:
    """10 GiB: checkpointing alone (or with the bf16 head) is predicted over the budget, so it comes
    with a halved micro-batch."""
    alone = dataclasses.replace(AMBITIOUS, gradient_checkpointing=True)
    assert memory_model.estimate_peak(SHAPE_7B, alone) > 10 * GiB / 1.08
    assert memory_model.estimate_peak(SHAPE_7B, dataclasses.replace(alone, bf16_head=True)) > 10 * GiB / 1.08
    result = preflight(SHAPE_7B, AMBITIOUS, 10 * GiB)
    assert result.knobs.gradient_checkpointing and result.knobs.micro_batch_size < 4
    assert result.knobs.max_seq_len == 2048


def test_the_128k_vocabulary_case_keeps_its_sequence_length() -> None:
    """The issue's case: a 1B with 128k vocabulary at seq 4096 under a 12 GiB cap keeps seq 4096."""
    job = dataclasses.replace(AMBITIOUS, max_seq_len=4096)
    result = preflight(SHAPE_1B, job, 12 * GiB)
    assert result.fits and result.knobs.max_seq_len == 4096 and not result.quality_changed


def test_quality_changes_only_when_nothing_else_fits_and_say_so() -> None:
    """Too small a card for any throughput change: seq_len shrinks, flagged loudly, throughput maxed."""
    job = dataclasses.replace(AMBITIOUS, max_seq_len=16384)
    result = preflight(SHAPE_7B, job, 6 * GiB)
    assert result.quality_changed and result.fits
    assert result.knobs.max_seq_len < 16384
    assert result.knobs.gradient_checkpointing and result.knobs.optimizer == "paged_adamw_8bit"
    assert any("QUALITY" in reason for reason in result.reasons)


def test_nothing_fits_is_reported_not_hidden() -> None:
    """A budget below the weights: the smallest config is returned with fits False."""
    result = preflight(SHAPE_7B, AMBITIOUS, 1 * GiB)
    assert not result.fits and result.quality_changed


def test_a_calibration_scale_moves_the_choice() -> None:
    """A calibration saying activations are twice the estimate makes the pre-flight cut deeper."""
    plain = preflight(SHAPE_7B, AMBITIOUS, 16 * GiB)
    scaled = preflight(SHAPE_7B, AMBITIOUS, 16 * GiB, scale=2.0)
    assert scaled.knobs.micro_batch_size < plain.knobs.micro_batch_size


def test_rung_effects_say_cost_class_and_peak() -> None:
    """Each rung alone: its predicted peak (None when it changes nothing) and its cost class."""
    effects = {e.name: e for e in rung_effects(SHAPE_7B, AMBITIOUS)}
    assert effects["expandable_segments"].cost_class is CostClass.FREE
    assert effects["gradient_checkpointing"].cost_class is CostClass.THROUGHPUT
    assert effects["shorten_seq_len"].cost_class is CostClass.QUALITY
    assert effects["paged_8bit_optimizer"].predicted_peak is None  # already paged 8-bit
    gc_peak = effects["gradient_checkpointing"].predicted_peak
    assert gc_peak is not None and gc_peak < memory_model.estimate_peak(SHAPE_7B, AMBITIOUS)


def test_rung_costs_come_from_the_throughput_model() -> None:
    """Each rung's cost is the throughput model's tokens/s after it against the job's (the fixed
    rung costs are gone): checkpointing and a halved micro-batch cost, expandable segments is free."""
    effects = {e.name: e for e in rung_effects(SHAPE_7B, AMBITIOUS)}
    base = throughput.predict(SHAPE_7B, AMBITIOUS).tokens_per_s
    ckpt = effects["gradient_checkpointing"]
    assert ckpt.tokens_per_s is not None and ckpt.cost == round(1 - ckpt.tokens_per_s / base, 4) > 0.1
    assert 0 < effects["halve_micro_batch"].cost < ckpt.cost
    assert effects["expandable_segments"].cost == 0.0
