"""The memory model's per-family terms against the CPU counts of bench/models/family_memory_cpu.py.

    python -m bench.models.score_family_cpu [bench/results/family-memory-cpu-2026-12-02/family-memory.json]

For every recorded point it compares what the model says one steady-state decoder block keeps
per token (``gpu.layer_activation_bytes``, layer 1 of the two built: layer 0's input needs no
gradient and keeps less) and what the model's static terms say is resident, with what the
saved-tensor hooks and the parameter walk counted. The CPU count is first put on CUDA's footing
where the two differ by a known rule: a LoRA dropout mask is 2 bytes a feature on the CPU, 1 on
CUDA (aten's ``native_dropout``). The fp32 log-sum-exp SDPA keeps (4 bytes per head) and a few
bytes of index tensors stay in the CPU count: the model leaves them out. Prints a table; not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from qlora_supervise.policies.memory import gpu
from qlora_supervise.policies.memory.gpu import attention_bytes
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.trainer_child.contract.spec import Knobs

DEFAULT = (
    Path(__file__).resolve().parents[1] / "results" / "family-memory-cpu-2026-12-02" / "family-memory.json"
)
STEADY_LAYER = "layer.1"


def shape_of(family: dict[str, Any]) -> ModelShape:
    config = dict(family["shape"]["config"])
    config.update(model_type=family["shape"]["model_type"], vocab_size=family["shape"]["vocab"])
    config.setdefault("num_hidden_layers", 2)
    shape = ModelShape.read(config)
    if not isinstance(shape, ModelShape):
        raise SystemExit(f"{family['shape']['key']}: not modelled: {shape.detail}")
    return shape


def predicted_layer(shape: ModelShape, family: dict[str, Any], targets: str, seq: int, r: int = 8) -> int:
    """Layer 1's per-token bytes: the model's block (an average over the layer types), with layer
    1's own attention where the config lists the types (Gemma 3: full, or sliding in the variant)."""
    whole = gpu.layer_activation_bytes(shape, r, targets, 2, seq)
    types = family["shape"]["config"].get("layer_types")
    if isinstance(types, list) and len(types) > 1:
        own = attention_bytes(shape, 2, seq, sliding=types[1] == "sliding_attention")
        whole += own - attention_bytes(shape, 2, seq)
    return whole


def cuda_footing(shape: ModelShape, targets: str, measured: float) -> float:
    """The CPU count with CUDA's 1-byte dropout masks (one byte less per adapted input feature)."""
    dims = shape.linear_dims()
    return measured - sum(dims[name][0] for name in shape.adapted(targets))


def resident(shape: ModelShape, build: dict[str, Any]) -> tuple[int, int]:
    """(predicted, counted) bytes of everything but the 4-bit weights' packing constants."""
    knobs = Knobs(model="m", lora_r=8, lora_alpha=16)
    predicted = gpu.static_components(shape, knobs, build["targets"])
    predicted.pop("weights_4bit")
    groups = build["resident"]["groups"]
    counted = sum(size for dtypes in groups.values() for size in dtypes.values())
    return sum(predicted.values()), counted


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("counts", type=Path, nargs="?", default=DEFAULT, help="family-memory.json")
    path = parser.parse_args(argv).counts
    report = json.loads(path.read_text(encoding="utf-8"))
    rows, errors = [], []
    for key, family in report["families"].items():
        shape = shape_of(family)
        for build in family["builds"]:
            if build["gradient_checkpointing"]:
                continue
            pred_static, counted = resident(shape, build)
            for point in build["points"]:
                if not point["autocast_bf16"] or not point["head_branch"].startswith("gpu"):
                    continue
                measured = point["saved"]["activations"][STEADY_LAYER] / point["tokens"]
                on_cuda = cuda_footing(shape, build["targets"], measured)
                pred = predicted_layer(shape, family, build["targets"], point["seq_len"])
                error = (pred - on_cuda) / on_cuda
                errors.append((key, abs(error)))
                rows.append(
                    f"{key:12} {build['targets']:10} b{point['micro_batch']} s{point['seq_len']:<5} "
                    f"{on_cuda:9.0f} {pred:9d} {error:+7.2%}   {counted:>11} {pred_static:>11} "
                    f"{(pred_static - counted) / counted:+.3%}"
                )
    print(f"{'family':12} {'targets':10} {'point':9} {'counted':>9} {'model':>9} {'error':>7}   "
          f"{'resident':>11} {'model':>11} error")  # fmt: skip
    print("\n".join(rows))
    for key in dict.fromkeys(k for k, _ in errors):
        mine = [e for k, e in errors if k == key]
        print(
            f"{key}: {len(mine)} points, median |error| {statistics.median(mine):.2%}, worst {max(mine):.2%}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
