"""FSDP-QLoRA in the plan: a 70B-shaped job that fits no single capped card fits on two under FSDP."""

from __future__ import annotations

import io
from pathlib import Path

from test_plan import make_job

from qlora_supervise.policies.memory.gpu import training_phases
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.supervisor.commands.plan import make_plan, plan_command
from qlora_supervise.trainer_child.contract.spec import Knobs

LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": False,
}
#: An 80 GB card capped to 40 GiB: the 4-bit 70B weights alone (33 GiB) and its fp32 head leave no
#: room for a step on one card at any config, while each of two FSDP ranks holds half the blocks.
CAPPED = "resources: {gpu_memory_limit: 40GiB, nproc_per_node: 2%s}\n"


def test_a_70b_job_that_fits_no_single_capped_card_fits_on_two_under_fsdp(tmp_path: Path) -> None:
    """DDP (a replica per card) finds nothing that fits; FSDP-QLoRA fits as written, per rank."""
    (tmp_path / "ddp").mkdir(), (tmp_path / "fsdp").mkdir()
    ddp = make_plan(str(make_job(tmp_path / "ddp", LLAMA_70B, CAPPED % "")), None)
    assert not ddp["fits_as_written"] and not ddp["start"]["fits"]
    fsdp = make_plan(str(make_job(tmp_path / "fsdp", LLAMA_70B, CAPPED % ", parallel: fsdp")), None)
    start = fsdp["start"]
    assert start["fits"] and not start["quality_changed"]
    knobs = start["knobs"]
    assert knobs["fsdp"] and knobs["world_size"] == 2 and knobs["max_seq_len"] == 4096
    assert knobs["micro_batch_size"] * knobs["grad_accum"] * 2 == 16  # the job's batch
    assert start["peak_bytes"] <= fsdp["card"]["budget_bytes"] / 1.02
    out = io.StringIO()
    plan_command(str(tmp_path / "fsdp" / "job.yaml"), None, out=out)
    assert "(per rank, 2 ranks, FSDP: weights sharded)" in out.getvalue()  # what plan prints


def test_fsdp_shards_the_blocks_and_keeps_the_root_and_two_gathered_blocks_whole() -> None:
    """Per rank: 1/N of the 4-bit blocks, two gathered, the 16-bit root whole; the load holds all of it."""
    shape = ModelShape.from_config(LLAMA_70B)
    one, two, four = (
        training_phases(shape, Knobs(model="m", world_size=n, fsdp=n > 1, max_seq_len=1024), "attention", 2)
        for n in (1, 2, 4)
    )
    one, two, four = one["backward"], two["backward"], four["backward"]
    block = two["gathered_blocks"] // 2
    for ranks, per_rank in ((2, two), (4, four)):
        assert abs(per_rank["weights_4bit_shard"] * ranks - 80 * block) <= ranks
    assert 80 * block >= one["weights_4bit"]  # the blocks' norms ride along in their units
    assert two["embeddings_bf16"] * 2 == one["embeddings_fp32"]  # not upcast: one flat dtype per unit
    load = training_phases(shape, Knobs(model="m", world_size=2, fsdp=True), "attention", 2)["load"]
    assert "load_cast_16bit" not in load and load["weights_4bit"] == 80 * block  # whole while it loads
