"""Coefficients of the throughput model (search/throughput.py), written by bench/models/fit_throughput.py.

Fitted 2026-12-02 on 75 configs from: bench/results/throughput-h200-2026-12-01.

Error of tokens/s on those configs: median 8.1 %, worst 73.6 %.

Recompute share with checkpointing (token cost on / off - 1): 0.30.

bf16 head factor 1.0 (no speed claimed): the measurements disagree (issue 19 (8B 128k, micro 1,
ckpt): 0.45; throughput-h200-2026-12-01/parity.jsonl: 1.52).

Choosing among the configs measured to fit a cap of 8, 12, 16, 24, 40, 80 GiB, the model's pick has
this share of the fastest: median 100 %, worst 87 %, 37 of 40 at >= 95 % (bench/models/fit_throughput.py
prints the table).

The fit keeps no cost per weight byte: with the 1B beside the 7B and 8B, the fixed part of a
micro-step follows the layer count (kernel launches), not the bytes dequantized.

Do not edit by hand: run ``python -m bench.models.fit_throughput --write`` on the sweep instead.
"""

from __future__ import annotations

from collections.abc import Mapping

PROVISIONAL = False
#: Seconds per micro-step per decoder layer (kernel launches), by checkpointing mode.
LAUNCH_S_PER_LAYER: Mapping[str, float] = {
    "ckpt": 0.008992762,
    "no_ckpt": 0.005032916,
}
#: Seconds per micro-step per byte of 4-bit weights (dequantization), by checkpointing mode.
FIXED_S_PER_BYTE: Mapping[str, float] = {
    "ckpt": 0.0,
    "no_ckpt": 0.0,
}
#: Seconds per token per multiply-add of the decoder blocks' forward, by checkpointing mode.
TOKEN_S: Mapping[str, float] = {
    "ckpt": 1.240255e-14,
    "no_ckpt": 9.552673e-15,
}
#: Seconds per token per multiply-add of the LM head (and its loss), by checkpointing mode.
HEAD_TOKEN_S: Mapping[str, float] = {
    "ckpt": 2.428107e-14,
    "no_ckpt": 2.263684e-14,
}
#: Seconds of the optimizer step per adapter parameter, by optimizer kind.
OPTIMIZER_S_PER_PARAM: Mapping[str, float] = {
    "adamw_torch": 3.34553e-10,
    "adamw_torch_fused": 1e-09,
    "paged_adamw_8bit": 1.118507e-09,
}
#: The per-token part's factor with the embeddings and LM head left in bf16 (bf16_head).
BF16_HEAD_TOKEN_FACTOR = 1.0000
