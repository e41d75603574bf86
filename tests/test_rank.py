"""Rank reduction by truncated SVD: the smaller adapter is the best low-rank approximation of ΔW."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from qlora_supervise.trainer_child.contract.attempt_facts import RankReduction
from qlora_supervise.trainer_child.contract.events import Resumed, parse_event
from qlora_supervise.trainer_child.run.failure import ConfigError

# torch (and recipe.resume, which imports it) are imported by the tests that run, not at collection:
# every xdist worker collects every module.
if TYPE_CHECKING:
    import torch


def _factors(out: int, inner: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    generator = torch.Generator().manual_seed(seed)
    # Decaying column norms give the update a spread of singular values, like a trained one.
    decay = torch.logspace(0, -1.5, rank)
    b = torch.randn(out, rank, generator=generator) * decay
    a = torch.randn(rank, inner, generator=generator)
    return b, a


def test_truncated_factors_reproduce_the_rank_k_svd_of_the_update() -> None:
    """scale'·B'A' equals the rank-k SVD reconstruction of ΔW, and keeps its top singular directions."""
    import torch

    from qlora_supervise.trainer_child.recipe.resume import lora_scale, truncate_pair

    b, a = _factors(96, 80, 8, seed=0)
    scale, new_scale = lora_scale(16, 8), lora_scale(8, 4)
    delta = scale * (b.double() @ a.double())
    u, s, vh = torch.linalg.svd(delta)
    best = u[:, :4] @ torch.diag(s[:4]) @ vh[:4]

    b_new, a_new, singular = truncate_pair(b, a, scale, 4, new_scale)

    assert b_new.shape == (96, 4) and a_new.shape == (4, 80)
    approx = new_scale * (b_new.double() @ a_new.double())
    assert torch.allclose(approx, best, atol=1e-4 * float(s[0]))
    assert torch.allclose(singular.double(), s[:8], rtol=1e-4)
    # The same top-4 directions (up to sign): |u_i . u'_i| = 1 for the left and right vectors.
    u2, s2, vh2 = torch.linalg.svd(approx)
    assert torch.allclose(s2[:4], s[:4], rtol=1e-4)
    assert torch.allclose((u[:, :4] * u2[:, :4]).sum(0).abs(), torch.ones(4, dtype=torch.float64), atol=1e-4)
    assert torch.allclose((vh[:4] * vh2[:4]).sum(1).abs(), torch.ones(4, dtype=torch.float64), atol=1e-4)
    # The two factors carry the singular values evenly (neither is the whole update).
    assert torch.allclose(b_new.norm(dim=0), a_new.norm(dim=1), rtol=1e-4)


def test_energy_share_is_the_top_k_share_of_squared_singular_values() -> None:
    """The energy kept is Σ top-k s² / Σ s², and a zero update keeps everything."""
    import torch

    from qlora_supervise.trainer_child.recipe.resume import energy_share, truncate_pair

    b, a = _factors(64, 48, 8, seed=1)
    _, _, singular = truncate_pair(b, a, 2.0, 4, 2.0)
    s = torch.linalg.svdvals(2.0 * b.double() @ a.double())
    expected = float((s[:4] ** 2).sum() / (s**2).sum())
    assert energy_share(singular, 4) == pytest.approx(expected, rel=1e-5)
    assert 0.5 < energy_share(singular, 4) < 1.0
    assert energy_share(singular, 8) == pytest.approx(1.0)
    assert energy_share(torch.zeros(8), 4) == 1.0


def _adapter(directory: Path, modules: int, rank: int, alpha: int) -> dict[str, torch.Tensor]:
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True)
    weights = {}
    for index in range(modules):
        b, a = _factors(32, 24, rank, seed=10 + index)
        prefix = f"base_model.model.model.layers.{index}.self_attn.q_proj"
        weights[f"{prefix}.lora_A.weight"] = a.to(torch.bfloat16)
        weights[f"{prefix}.lora_B.weight"] = b.to(torch.bfloat16)
    save_file(weights, str(directory / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"r": rank, "lora_alpha": alpha, "use_rslora": False, "rank_pattern": {}, "alpha_pattern": {}}
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return weights


def test_truncate_adapter_rewrites_the_files_at_the_new_rank_and_reports_the_energy(tmp_path: Path) -> None:
    """A saved r 8 adapter is rewritten at r 4 (config, shapes, dtype), with overall and worst energy kept."""
    import torch
    from safetensors.torch import load_file

    from qlora_supervise.trainer_child.recipe.resume import truncate_adapter

    old = _adapter(tmp_path / "ckpt", modules=3, rank=8, alpha=16)

    reduction = truncate_adapter(tmp_path / "ckpt", 4, 8)

    new = load_file(str(tmp_path / "ckpt" / "adapter_model.safetensors"))
    config = json.loads((tmp_path / "ckpt" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (4, 8)
    assert set(new) == set(old)
    assert all(t.dtype == torch.bfloat16 for t in new.values())
    assert all(new[k].shape[0 if ".lora_A." in k else 1] == 4 for k in new)
    shares, top, total = {}, 0.0, 0.0
    for key in old:
        if ".lora_A." in key:
            b_key = key.replace(".lora_A.", ".lora_B.")
            s = torch.linalg.svdvals(2.0 * old[b_key].double() @ old[key].double())
            shares[key.split(".lora_A.")[0]] = float((s[:4] ** 2).sum() / (s**2).sum())
            top, total = top + float((s[:4] ** 2).sum()), total + float((s**2).sum())
            approx = 2.0 * new[b_key].double() @ new[key].double()  # alpha 8 / r 4
            assert torch.linalg.matrix_rank(approx.float()) == 4
    worst = min(shares, key=shares.__getitem__)
    assert isinstance(reduction, RankReduction)
    assert (reduction.rank_from, reduction.rank_to, reduction.modules) == (8, 4, 3)
    assert reduction.energy_kept == pytest.approx(top / total, rel=1e-3)
    assert reduction.worst_module == worst
    assert reduction.worst_energy_kept == pytest.approx(shares[worst], rel=1e-3)
    resumed = parse_event({"event": "resumed", **reduction.fields()})
    assert isinstance(resumed, Resumed) and resumed.rank_reduction == reduction


def test_an_adapter_of_a_smaller_rank_cannot_grow(tmp_path: Path) -> None:
    """Asking for a larger rank than the saved one is a config error that names both ranks."""

    from qlora_supervise.trainer_child.recipe.resume import truncate_adapter

    _adapter(tmp_path / "ckpt", modules=1, rank=4, alpha=8)
    with pytest.raises(ConfigError, match="rank 4 is smaller than lora_r 8"):
        truncate_adapter(tmp_path / "ckpt", 8, 16)
