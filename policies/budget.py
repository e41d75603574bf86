"""The memory budget the policy plans against, when the job sets no cap.

A card's total is not all usable: the CUDA context (about 0.5 GiB on recent cards, outside
PyTorch's allocator), cuBLAS/cuDNN workspaces and the allocator's rounding all sit beside the
tensors the memory model counts. The reserve is 5 % of the card, and at least 1 GiB, so a
24 GiB card plans with 23 GiB and an 8 GiB card with 7 GiB.
"""

from __future__ import annotations

RESERVE_SHARE = 0.05
RESERVE_MIN_BYTES = 1 << 30


def card_reserve(total_bytes: int) -> int:
    """Bytes of a card of ``total_bytes`` kept out of the budget."""
    return max(RESERVE_MIN_BYTES, int(total_bytes * RESERVE_SHARE))


def card_budget(total_bytes: int) -> int:
    """The budget on a whole card: its total less :func:`card_reserve`."""
    return max(0, total_bytes - card_reserve(total_bytes))
