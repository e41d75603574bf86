"""Which attention the planner assumes: read from the installed transformers' modeling source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from qlora_supervise.policies.memory import families as attention
from qlora_supervise.policies.memory.shape import ModelShape


def test_the_flag_is_read_from_the_pretrained_model_class_alone() -> None:
    """Only a ``*PreTrainedModel`` class's own boolean assignment counts."""
    source = (
        "class Helper:\n    _supports_sdpa = False\n"
        "class Gemma2PreTrainedModel(PreTrainedModel):\n    _supports_flash_attn = True\n"
        "    _supports_sdpa = True  # a comment\n"
    )
    assert attention.supports_sdpa_in(ast.parse(source)) is True
    assert (
        attention.supports_sdpa_in(ast.parse("class XPreTrainedModel:\n    _supports_sdpa: bool = False\n"))
        is False
    )
    assert attention.supports_sdpa_in(ast.parse("class XPreTrainedModel:\n    pass\n")) is None
    assert attention.supports_sdpa_in(ast.parse("class X:\n    _supports_sdpa = True\n")) is None


def _fake_release(root: Path, module: str, supports: bool) -> Path:
    folder = root / "models" / module
    folder.mkdir(parents=True)
    (folder / f"modeling_{module}.py").write_text(
        f"class {module.title()}PreTrainedModel:\n    _supports_sdpa = {supports}\n"
    )
    return root


def test_a_release_whose_gemma2_takes_sdpa_is_planned_with_sdpa(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers 5.17 sets Gemma 2's flag True (its H200 run used SDPA); 5.24 sets it False."""
    for supports, expected in ((True, "sdpa"), (False, "eager")):
        root = _fake_release(tmp_path / str(supports), "gemma2", supports)
        monkeypatch.setattr(attention, "_transformers_root", lambda root=root: root)
        assert attention.default_attention("gemma2") == expected


def test_a_class_that_sets_no_flag_inherits_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """PreTrainedModel's own ``_supports_sdpa`` is False: a modeling file that never sets it is eager."""
    folder = tmp_path / "models" / "llama"
    folder.mkdir(parents=True)
    (folder / "modeling_llama.py").write_text("class LlamaPreTrainedModel:\n    pass\n")
    monkeypatch.setattr(attention, "_transformers_root", lambda: tmp_path)
    assert attention.default_attention("llama") == "eager"


def test_without_the_source_the_pinned_release_reading_holds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No transformers to read: Gemma 2 eager (5.24's choice), the rest SDPA."""
    monkeypatch.setattr(attention, "_transformers_root", lambda: None)
    assert attention.default_attention("gemma2") == "eager"
    assert attention.default_attention("qwen3") == "sdpa"
    monkeypatch.setattr(attention, "_transformers_root", lambda: tmp_path)  # a folder without models/
    assert attention.default_attention("gemma2") == "eager"


def test_the_installed_release_agrees_with_what_its_model_class_says() -> None:
    """Against the transformers installed here, for each modelled family with its own module."""
    import importlib

    for model_type, module, cls in (
        ("gemma2", "gemma2", "Gemma2PreTrainedModel"),
        ("gemma3_text", "gemma3", "Gemma3PreTrainedModel"),
        ("qwen3", "qwen3", "Qwen3PreTrainedModel"),
        ("phi3", "phi3", "Phi3PreTrainedModel"),
    ):
        flag = getattr(
            importlib.import_module(f"transformers.models.{module}.modeling_{module}"), cls
        )._supports_sdpa
        assert attention.default_attention(model_type) == ("sdpa" if flag else "eager"), model_type
    shape = ModelShape.read({"model_type": "gemma2", "hidden_size": 256, "intermediate_size": 512,
                             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                             "head_dim": 64, "vocab_size": 1024})  # fmt: skip
    assert isinstance(shape, ModelShape) and shape.attn_implementation == attention.default_attention(
        "gemma2"
    )
