"""What a memory give-up says about the cap: which one, the smallest peak, the prediction, what helps."""

from __future__ import annotations

from qlora_supervise.policies.memory_model import ModelShape
from qlora_supervise.supervisor.diagnosis.advice import CARD, HOST_RAM, Cap, cap_of, cap_words
from qlora_supervise.trainer_child.contract.spec import Knobs

GIB = 1 << 30


def test_the_cap_is_the_gpu_limit_then_the_cpu_limit_then_the_card_or_host_ram() -> None:
    """The job's own limit names the cap; without one it is the card, or the host's RAM on the CPU."""
    assert cap_of(6 * GIB, 8 * GIB, 80 * GIB) == Cap("resources.gpu_memory_limit", 6 * GIB)
    assert cap_of(None, 8 * GIB, None) == Cap("resources.cpu_memory_limit", 8 * GIB)
    assert cap_of(None, None, 80 * GIB) == Cap(CARD, 80 * GIB)
    assert cap_of(None, None, None, device="cpu") == Cap(HOST_RAM, None)


def test_cap_words_name_the_cap_the_prediction_and_the_ways_out() -> None:
    """With a model shape the sentence carries the memory model's prediction for the last config."""
    shape = ModelShape(hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256)
    words = cap_words(Cap(CARD, 24 * GIB), [], Knobs(model="/m"), shape)
    assert words.startswith("the cap is the card (24.00 GiB)")
    assert "the memory model predicts" in words and "a card with more memory" in words
    assert "smallest peak seen" not in words  # no attempt recorded a peak
