"""bench.models.fit_throughput reads the sweep's JSON lines and recovers the coefficients that made them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.models import (
    _qlora_bench,  # the sweep's shapes, as throughput_sweep writes them
    fit_throughput,
)
from qlora_supervise.policies.memory.shape import ModelShape
from qlora_supervise.policies.search import throughput

#: Coefficients to generate a sweep from (the fit must find them again).
FIXED = {"no_ckpt": 3e-11, "ckpt": 4.5e-11}
TOKEN = {"no_ckpt": 1.2e-14, "ckpt": 1.6e-14}
OPTIMIZER = {"paged_adamw_8bit": 2e-9, "adamw_torch": 1.5e-9}


def _sweep(path: Path) -> None:
    lines = [{"kind": "environment"}]
    for name, config in _qlora_bench.SHAPES.items():
        lines.append({"kind": "shape", "shape": name, "config": config})
        shape = ModelShape.from_config(config)
        assert shape is not None
        for ckpt in (False, True):
            for micro in (1, 2, 4, 8, 16):
                for optimizer in OPTIMIZER:
                    lines.append(_config(name, shape, micro, ckpt, optimizer))
        lines.append({"kind": "config", "shape": name, "seq": 2048, "micro": 32, "checkpointing": False,
                      "optimizer": "adamw_torch", "r": 16, "status": "oom"})  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


def _config(name: str, shape: ModelShape, micro: int, ckpt: bool, optimizer: str) -> dict[str, object]:
    knobs = fit_throughput.Knobs(
        model=name,
        micro_batch_size=micro,
        grad_accum=1,
        max_seq_len=2048,
        gradient_checkpointing=ckpt,
        optimizer=optimizer,
        lora_r=16,
    )
    point = fit_throughput.Point(name, shape, knobs, 1.0)
    mode = "ckpt" if ckpt else "no_ckpt"
    tokens = micro * 2048
    micro_s = FIXED[mode] * throughput.weight_bytes(shape, point.knobs)
    micro_s += TOKEN[mode] * tokens * throughput.work_per_token(shape, 2048)
    opt = OPTIMIZER[optimizer] * throughput.adapter_params(shape, point.knobs, fit_throughput.TARGETS)
    return {"kind": "config", "shape": name, "seq": 2048, "micro": micro, "checkpointing": ckpt,
            "optimizer": optimizer, "r": 16, "status": "ok", "tokens_per_s": tokens / (micro_s + opt),
            "optimizer_s": opt, "s_per_micro_step": micro_s + opt}  # fmt: skip


def test_the_fit_recovers_the_coefficients_of_a_sweep(tmp_path: Path) -> None:
    """Three shapes, micro 1-16, both modes: every coefficient comes back, every config within 0.1 %."""
    _sweep(tmp_path / "sweep.jsonl")
    points = fit_throughput.sweep_points([tmp_path])
    assert len(points) == 3 * 2 * 5 * 2  # the OOM lines are not points
    result = fit_throughput.fit(points)
    for mode in FIXED:
        assert result.fixed_s_per_byte[mode] == pytest.approx(FIXED[mode], rel=1e-3)
        assert result.token_s[mode] == pytest.approx(TOKEN[mode], rel=1e-3)
        assert result.launch_s_per_layer[mode] == pytest.approx(0.0, abs=1e-9)
        assert result.head_token_s[mode] == pytest.approx(0.0, abs=1e-20)
    for kind, value in OPTIMIZER.items():
        assert result.optimizer_s_per_param[kind] == pytest.approx(value, rel=1e-6)
    assert max(abs(e) for e in fit_throughput.prediction_errors(points, result)) < 1e-3


def test_the_written_module_is_importable_and_says_where_it_came_from(tmp_path: Path) -> None:
    """The module the fit writes holds the coefficients and the fit's provenance and error."""
    _sweep(tmp_path / "sweep.jsonl")
    points = fit_throughput.sweep_points([tmp_path])
    text = fit_throughput.render_module(fit_throughput.fit(points), ["the test's sweep"], points, False, "")
    namespace: dict[str, object] = {}
    exec(compile(text, "throughput_fit.py", "exec"), namespace)
    assert namespace["PROVISIONAL"] is False and "the test's sweep" in str(namespace["__doc__"])
    assert "median 0.0 %" in str(namespace["__doc__"])
