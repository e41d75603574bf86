"""One gloo rank of tests/test_fsdp_ranks.py: the recipe's FSDP-QLoRA model (its own load and LoRA
functions), sharded by decoder block with torch's FSDP2 as the Trainer's FSDP would on GPUs, trained a
few steps. Run as ``torchrun --nproc-per-node 2 tests/fsdp_ranks.py SPEC OUT``; each rank writes
``OUT/rank<N>.json``. accelerate makes CPU ranks DDP, so the Trainer itself cannot shard here."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from qlora_supervise.trainer_child.contract.spec import AttemptSpec
from qlora_supervise.trainer_child.recipe import fsdp, qlora


def local_numel(parameter: torch.Tensor) -> int:
    to_local = getattr(parameter, "to_local", None)  # a DTensor: this rank's shard
    return int(to_local().numel() if to_local is not None else parameter.numel())


def main(spec_path: str, out: str) -> None:
    spec = AttemptSpec.from_json(Path(spec_path).read_text(encoding="utf-8"))
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dtype = qlora.compute_dtype(spec.train.compute_dtype, on_cuda=False)
    qlora.set_seed(spec.train.seed)
    model = qlora.add_lora(qlora.load_model(spec, dtype, on_cuda=False), spec.knobs, spec, dtype)
    kinds = sorted({f"{type(p).__name__}:{p.dtype}" for p in model.parameters() if not p.requires_grad})
    total = sum(p.numel() for p in model.parameters())
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
    blocks = fsdp.block_classes(model)
    for module in model.modules():
        if type(module).__name__ in blocks:
            fully_shard(module, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    trainable = [p for p in model.parameters() if p.requires_grad]
    before = [p.full_tensor().clone() for p in trainable]  # type: ignore[attr-defined]
    optimizer = torch.optim.AdamW(trainable, lr=spec.train.learning_rate)
    generator = torch.Generator().manual_seed(rank)  # each rank its own micro-batches, as DDP/FSDP split
    losses = []
    for _ in range(spec.train.max_steps):
        ids = torch.randint(
            5, 900, (spec.knobs.micro_batch_size, spec.knobs.max_seq_len), generator=generator
        )
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    after = [p.full_tensor() for p in trainable]  # type: ignore[attr-defined]
    moved = sum(float((a - b).abs().sum()) for a, b in zip(after, before, strict=True))
    digest = float(sum(a.double().sum() for a in after))  # equal on every rank: one adapter, sharded
    result = {
        "rank": rank,
        "total_params": total,
        "local_params": sum(local_numel(p) for p in model.parameters()),
        "frozen_kinds": kinds,
        "blocks": blocks,
        "losses": losses,
        "adapter_moved": moved,
        "adapter_digest": digest,
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result), encoding="utf-8")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
