"""`qlora-supervise plan` with the throughput model: ranking, speed trial, nothing fits, a fallback."""

from __future__ import annotations

import io
import json
from pathlib import Path

from test_plan import LLAMA3_8B, make_job

from qlora_supervise.supervisor.commands.plan import make_plan, plan_command

LLAMA32_1B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "tie_word_embeddings": True,
}


def test_plan_json_ranks_every_fitting_candidate_by_tokens_per_s(tmp_path: Path) -> None:
    """--json: the ranking is fastest first, its first entry is the start, and each has its tokens/s."""
    plan = make_plan(str(make_job(tmp_path, LLAMA3_8B)), "24GiB")
    ranking = plan["ranking"]
    rates = [c["tokens_per_s"] for c in ranking]
    assert len(ranking) > 3 and rates == sorted(rates, reverse=True)
    assert plan["start"]["tokens_per_s"] == rates[0] and plan["start"]["nothing_fits"] is None
    assert all(c["peak_bytes"] <= plan["card"]["budget_bytes"] / 1.08 for c in ranking)
    assert len(plan["start"]["speed_trial"]) >= 2
    assert all(r["tokens_per_s"] is None or r["tokens_per_s"] > 0 for r in plan["rungs"])


def test_plan_text_shows_the_ranking_with_tokens_per_s(tmp_path: Path) -> None:
    """The text view lists the ranked candidates with their tokens/s."""
    out = io.StringIO()
    plan_command(str(make_job(tmp_path, LLAMA3_8B)), gpu_memory="24GiB", out=out)
    text = out.getvalue()
    assert "fitting candidate(s), fastest first" in text and " 1. " in text and "tok/s" in text


def test_plan_says_when_nothing_fits_and_what_would_help(tmp_path: Path) -> None:
    """A 3 GiB card for the 8B: the start says NOTHING FITS, with the smallest peak, the budget and help."""
    job = make_job(tmp_path, LLAMA3_8B)
    plan = make_plan(str(job), "3GiB")
    nothing = plan["start"]["nothing_fits"]
    assert not plan["start"]["fits"] and nothing is not None and plan["ranking"] == []
    assert nothing["smallest_peak_bytes"] > nothing["budget_bytes"] / 1.08
    assert "model.fallbacks" in nothing["help"]
    out = io.StringIO()
    plan_command(str(job), gpu_memory="3GiB", out=out)
    assert "NOTHING FITS" in out.getvalue() and "what would help" in out.getvalue()


def test_plan_starts_the_first_fallback_that_fits(tmp_path: Path) -> None:
    """A 4 GiB card: nothing of the 8B fits, the 1B fallback does and is named as the start."""
    small = tmp_path / "small"
    small.mkdir()
    (small / "config.json").write_text(json.dumps(LLAMA32_1B))
    job = make_job(tmp_path, LLAMA3_8B)
    text = job.read_text().replace("model: {path: model}", f"model: {{path: model, fallbacks: [{small}]}}")
    job.write_text(text)
    plan = make_plan(str(job), "4GiB")
    assert plan["start"]["fits"] and plan["start"]["fallback"] == str(small)
    assert plan["start"]["quality_changed"] and plan["start"]["knobs"]["model"] == str(small)
