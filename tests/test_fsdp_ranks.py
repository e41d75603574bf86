"""FSDP-QLoRA on two gloo ranks (CPU): the recipe's 4-bit model, stored in the compute dtype and never
upcast, shards by decoder block over the ranks and trains (tests/fsdp_ranks.py says what runs)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _child import make_spec, write_spec

pytestmark = pytest.mark.slow


def test_two_gloo_ranks_shard_the_recipes_fsdp_qlora_model_and_train_it(
    tiny_dir: Path, tmp_path: Path
) -> None:
    """Each rank holds half the parameters; the 4-bit codes and every frozen 16-bit parameter share the
    compute dtype (bf16); the one adapter moves, the same on both ranks."""
    knobs = {"world_size": 2, "fsdp": True, "micro_batch_size": 2, "max_seq_len": 64}
    spec = make_spec(tiny_dir, tmp_path / "run", knobs=knobs, train={"max_steps": 3, "compute_dtype": "bf16"})
    out = tmp_path / "out"
    out.mkdir()
    script = Path(__file__).with_name("fsdp_ranks.py")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    done = subprocess.run(
        [*argv, str(script), str(write_spec(spec)), str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    ranks = [json.loads((out / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    for result in ranks:
        assert result["blocks"] == ["LlamaDecoderLayer"]
        assert abs(result["local_params"] * 2 - result["total_params"]) <= 64  # half each (dim-0 shards)
        # No fp32 upcast (one dtype for FSDP): 4-bit codes stored as bf16, the rest bf16 too.
        assert result["frozen_kinds"] == ["Parameter:torch.bfloat16", "Params4bit:torch.bfloat16"]
        assert len(result["losses"]) == 3 and all(0 < loss < 20 for loss in result["losses"])
        assert result["adapter_moved"] > 0
    assert ranks[0]["adapter_digest"] == ranks[1]["adapter_digest"]
