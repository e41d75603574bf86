"""PROVISIONAL: coefficients of the throughput model (policies/throughput.py), written by
bench/fit_throughput.py.

Fitted 2026-12-02 on 6 configs from: issue 19's 7B numbers and rungs-table.txt
(memory-grid-h200-2026-12-01).

Error of tokens/s on those configs: median 1.3 %, worst 6.5 %.

Recompute share with checkpointing (token cost on / off - 1): 0.60.

One shape only (7B, seq 2048): the fixed and the per-token parts of other shapes are extrapolated;
refit on bench/results/throughput-h200-2026-12-01 (three shapes) when it lands.

Do not edit by hand: run ``python bench/fit_throughput.py --write`` on the sweep instead.
"""

from __future__ import annotations

from collections.abc import Mapping

PROVISIONAL = True
#: Seconds per micro-step per byte of 4-bit weights (dequantization), by checkpointing mode.
FIXED_S_PER_BYTE: Mapping[str, float] = {
    "ckpt": 6.682872e-12,
    "no_ckpt": 3.460617e-11,
}
#: Seconds per token per multiply-add of the base model's forward, by checkpointing mode.
TOKEN_S: Mapping[str, float] = {
    "ckpt": 1.845519e-14,
    "no_ckpt": 1.149924e-14,
}
#: Seconds of the optimizer step per adapter parameter, by optimizer kind.
OPTIMIZER_S_PER_PARAM: Mapping[str, float] = {
    "adamw_torch": 1.200000e-09,
    "adamw_torch_fused": 1.000000e-09,
    "paged_adamw_8bit": 1.700000e-09,
}
#: The per-token part's factor with the embeddings and LM head left in bf16 (bf16_head).
BF16_HEAD_TOKEN_FACTOR = 0.6801
