"""The real child trains a tiny random model of each architecture people fine-tune (issue 20):
targets resolved by model type, 4-bit layers, the loss falls, a checkpoint, a resume from it."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest
from _child import events, log_tail, make_spec, next_spec, run_child, shared_dir

from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.supervisor.jobfile.model_files import read_header
from qlora_supervise.trainer_child.contract.checkpoints import complete_checkpoints
from qlora_supervise.trainer_child.contract.codes import ExitCode
from qlora_supervise.trainer_child.contract.targets import FAMILIES

pytestmark = pytest.mark.slow

#: The families of issue 20 that recipe.tiny builds (the Llama demo is tests/test_child_train.py).
FAMILY_TYPES = ("gemma2", "gemma3_text", "phi3", "qwen3", "qwen3_moe")
FAST_LEARNING = {"learning_rate": 1e-2, "lr_scheduler": "constant"}


#: One process writes the tiny model of every family (one import of the stack, not five).
_WRITE_ALL = (
    "import sys; from pathlib import Path; from qlora_supervise.trainer_child.recipe.tiny import write_tiny; "
    f"[write_tiny(Path(sys.argv[1]) / family, family) for family in {FAMILY_TYPES!r}]"
)


@pytest.fixture(name="family_dir")
def family_dir_fixture(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model of the parametrized family, its tokenizer and data (all five written once per
    run, in a subprocess: the test process never imports torch)."""
    root = shared_dir(tmp_path_factory, "tiny-families", [sys.executable, "-c", _WRITE_ALL, "{dir}"])
    return root / request.param


def adapted_layers(adapter: Path) -> set[str]:
    """Leaf names of the layers the saved adapter holds LoRA weights for (``...qkv_proj.lora_A.weight``)."""
    names = read_header(adapter / "adapter_model.safetensors")
    return {name.split(".")[-3] for name in names if ".lora_" in name}


#: In the default run: Gemma 2 (eager attention, soft-capping, tied embeddings) and Qwen3-MoE
#: (experts beside the attention), the two furthest from the Llama path; the three others
#: (Gemma 3 text, Phi-3's fused layers, dense Qwen3) run with ``-m extended``: the code they go
#: through is the same, and their static facts (target names, attention, shape) are read by
#: tests/test_targets.py and tests/test_targets_shape.py in the default run.
DEFAULT_FAMILIES = ("gemma2", "qwen3_moe")


@pytest.mark.parametrize(
    "family_dir",
    [f if f in DEFAULT_FAMILIES else pytest.param(f, marks=pytest.mark.extended) for f in FAMILY_TYPES],
    indirect=True,
)
def test_each_family_trains_checkpoints_and_resumes_with_its_own_attention_names(
    family_dir: Path, tmp_path: Path
) -> None:
    """``target_modules: attention`` adapts the family's own layers through 4-bit weights with the
    attention the planner reads; the loss falls; a resume from step 3's checkpoint goes on to 6."""
    config = json.loads((family_dir / "model" / "config.json").read_text())
    shape = ModelShape.architecture(config)
    assert isinstance(shape, ModelShape), shape
    expected = set(FAMILIES[config["model_type"]].attention)
    run = tmp_path / "run"
    # Seq 64 and a constant, high rate (2e-2 diverged on Qwen3-MoE after the resume): the tiny
    # families have hidden 64, and the test pays for two child processes, so six steps must do.
    first = make_spec(
        family_dir,
        run,
        knobs={"max_seq_len": 64, "grad_accum": 2},
        train={"max_steps": 3, "save_steps": 3, "target_modules": "attention", **FAST_LEARNING},
    )
    assert run_child(first) == ExitCode.OK, log_tail(first)
    seen = events(first)
    loaded = next(e for e in seen if e["event"] == "loaded")
    assert loaded["linear4bit"] > 0 and 0 < loaded["trainable_share"] < 0.5
    assert loaded["attn_implementation"] == shape.attn_implementation  # what the planner assumes
    assert [step for step, _ in complete_checkpoints(first.checkpoints_dir)] == [3]
    checkpoint = Path(first.checkpoints_dir) / "checkpoint-3"
    assert adapted_layers(checkpoint) == expected

    second = next_spec(
        first, train=dataclasses.replace(first.train, max_steps=6), resume_from=str(checkpoint)
    )
    assert run_child(second) == ExitCode.OK, log_tail(second)
    resumed = events(second)
    assert next(e for e in resumed if e["event"] == "finished")["step"] == 6
    beats = [e for e in seen + resumed if e["event"] == "heartbeat" and e["step"] > 0]
    assert sorted({e["step"] for e in beats}) == list(range(1, 7))
    losses = {e["step"]: e["loss"] for e in beats if e["loss"] is not None}  # a save's beat has none
    # From ln(1024) ~ 6.93; six steps at hidden 64 measured 0.25-0.45 lower, the noise ~0.03.
    assert losses[6] < losses[1] - 0.15, losses
    assert adapted_layers(Path(second.adapter_dir)) == expected
