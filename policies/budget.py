"""The memory budget the policy plans against when the job sets no cap: the card less a reserve.

The reserve is what sits on the card but outside PyTorch's allocator, which is what the memory
model's peak counts: the CUDA context (``memory.gpu.CUDA_CONTEXT``, measured on the H200) and,
with a paged optimizer, its unified-memory state. ``plan`` and the loop use these same two
functions, so the budget ``plan`` prints is the one the run plans against.
"""

from __future__ import annotations

from qlora_supervise.policies.memory import gpu as gpu_terms


def card_reserve(paged_bytes: int = 0) -> int:
    """Bytes of a card kept out of the budget: the CUDA context plus paged optimizer state."""
    return gpu_terms.CUDA_CONTEXT + paged_bytes


def card_budget(total_bytes: int, paged_bytes: int = 0) -> int:
    """The budget on a whole card of ``total_bytes``: its total less :func:`card_reserve`."""
    return max(0, total_bytes - card_reserve(paged_bytes))
