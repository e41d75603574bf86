"""The planner's shape reader by architecture (issue 20, the facts of item 1): what ``plan`` says
it models, and what it does not and why, for the families people fine-tune."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import pytest

from qlora_supervise.policies.decide import Settings
from qlora_supervise.policies.memory.shape import ModelShape, Unsupported
from qlora_supervise.supervisor.commands.plan import make_plan, plan_command
from qlora_supervise.supervisor.loop.planner import first_plan
from qlora_supervise.trainer_child.contract.spec import Knobs

#: config.json of the released models, cut to the keys the reader looks at.
GEMMA2_2B = {
    "architectures": ["Gemma2ForCausalLM"],
    "model_type": "gemma2",
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "vocab_size": 256000,
    "tie_word_embeddings": True,
    "attn_logit_softcapping": 50.0,
    "final_logit_softcapping": 30.0,
    "sliding_window": 4096,
    "layer_types": ["sliding_attention", "full_attention"] * 13,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "moe_intermediate_size": 768,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "output_router_logits": False,
    "use_sliding_window": False,
    "sliding_window": None,
}
PHI3_MINI = {
    "architectures": ["Phi3ForCausalLM"],
    "model_type": "phi3",
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32064,
    "sliding_window": 2047,
}
QWEN25_7B = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "use_sliding_window": False,
    "sliding_window": 131072,
    "max_window_layers": 28,
}


def test_gemma2_is_read_eager_softcapped_tied_and_modelled() -> None:
    """Gemma 2 is read: eager for softcapping, head_dim 256, 256k tied, windows on half its layers."""
    facts = ModelShape.read(GEMMA2_2B)
    assert isinstance(facts, ModelShape) and facts.missing_terms() == ()
    assert (facts.model_type, facts.attn_implementation, facts.head_dim) == ("gemma2", "eager", 256)
    assert (facts.attn_softcap, facts.final_softcap) == (50.0, 30.0)
    assert facts.tie_word_embeddings and facts.vocab == 256000
    assert (facts.sliding_window, facts.sliding_layers) == (4096, 13)
    assert facts.block is not None and facts.block.norms == 4  # before and after attention and MLP


def test_moe_facts_are_the_expert_count_top_k_and_width() -> None:
    """Qwen3-30B-A3B: 128 experts of width 768, 8 routed per token, all resident and unquantized."""
    facts = ModelShape.read(QWEN3_30B_A3B)
    assert isinstance(facts, ModelShape)
    assert (facts.experts, facts.experts_per_token, facts.expert_intermediate) == (128, 8, 768)
    assert facts.sliding_window is None and not facts.router_logits
    # Attention alone is Linear (quantized); each block's experts and router are bare parameters.
    assert set(facts.linear_dims()) == {"q_proj", "k_proj", "v_proj", "o_proj"}
    assert facts.expert_params == 128 * (3 * 2048 * 768 + 2048)


def test_phi3_windows_every_layer_and_its_linear_layers_are_the_fused_ones() -> None:
    """Phi-3-mini's window applies to all 32 layers; its Linear layers are qkv_proj and gate_up_proj."""
    facts = ModelShape.read(PHI3_MINI)
    assert isinstance(facts, ModelShape) and facts.attn_implementation == "sdpa"
    assert (facts.sliding_window, facts.sliding_layers) == (2047, 32)
    dims = facts.linear_dims()
    assert dims["qkv_proj"] == (3072, 3 * 3072) and dims["gate_up_proj"] == (3072, 2 * 8192)
    assert facts.adapted("attention") == ("qkv_proj", "o_proj")


def test_qwen25_is_modelled_with_its_qkv_bias_and_no_window_and_keeps_its_store_key() -> None:
    """Qwen2.5 stays modelled; its q/k/v bias is read, its window is off; the store key is the eight sizes."""
    shape = ModelShape.read(QWEN25_7B)
    assert isinstance(shape, ModelShape)
    assert shape.qkv_bias and shape.sliding_window is None and shape.missing_terms() == ()
    old_fields = ("hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "tie_word_embeddings")
    assert set(shape.sizes()) == {*old_fields, "head_dim"}
    assert shape.sizes() == {k: v for k, v in dataclasses.asdict(shape).items() if k in shape.sizes()}


def test_a_model_type_outside_the_table_is_not_read_and_says_so() -> None:
    """Falcon gets no facts: the detail says its block is not read, so no term would be right."""
    read = ModelShape.read({"architectures": ["FalconForCausalLM"], "model_type": "falcon", "hidden_size": 8})
    assert isinstance(read, Unsupported) and read.shape is None
    assert "'falcon' is none of the families read" in read.detail and "not read" in read.detail


def _job(tmp_path: Path, config: dict[str, Any]) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    (tmp_path / "data.jsonl").write_text('{"text": "hello"}\n')
    job = tmp_path / "job.yaml"
    job.write_text(
        "model: {path: ./model}\ndata: {path: ./data.jsonl}\nlora: {target_modules: [q_proj, v_proj]}\n"
    )
    return job


#: Gemma 1: a block the targets table knows (so its facts are read) but the memory model does not.
GEMMA_7B = {**GEMMA2_2B, "architectures": ["GemmaForCausalLM"], "model_type": "gemma"}


@pytest.mark.parametrize("config", [GEMMA_7B, {**GEMMA2_2B, "model_type": "falcon"}])
def test_plan_says_what_it_does_not_model_and_that_the_ladder_alone_guards_the_run(
    tmp_path: Path, config: dict[str, Any]
) -> None:
    """plan on Gemma 1 names its facts and lacking terms; on an unknown type, that nothing is read."""
    job = _job(tmp_path, config)
    plan = make_plan(str(job), "24GiB")
    assert plan["peak_bytes"] is None and plan["unsupported"]["reason"] == "not_modelled"
    out = io.StringIO()
    plan_command(str(job), gpu_memory="24GiB", out=out)
    text = out.getvalue()
    assert "NOT MODELLED" in text and "the reactive ladder alone guards the run" in text
    if config["model_type"] == "gemma":
        assert plan["architecture"]["attn_implementation"] == "sdpa"
        assert any("256000-token logits" in term for term in plan["architecture"]["missing_terms"])
        assert "head_dim 256" in text
    else:
        assert plan["architecture"] is None and "none of the families read" in text


def test_run_without_a_modelled_shape_says_the_reactive_ladder_alone_guards_it() -> None:
    """Attempt 1 of a model the memory model does not cover runs as written, and its note says why."""
    knobs = Knobs(model="gemma-2-2b")
    plan = first_plan(knobs, Settings(budget_bytes=24 << 30), "attention", as_written=False, device="cuda:0")
    assert plan.knobs == knobs and plan.note is not None and plan.note.predicted_peak is None
    assert "the reactive ladder alone guards the run" in plan.note.why[0]
