"""Models, tokenizers and datasets of the benchmark, built once into a cache directory and shared.

The model shapes are ``bench/models/memory_grid.py``'s (random bf16 weights, a word-level tokenizer
trained locally, rows longer than the sequence): :func:`ensure_assets` calls its ``build_all``
under a file lock, so card commands started together build each shape once and the others wait
for it. What this module adds is the long-row dataset of the mid-run scenario.

Where the long row lands: the Trainer draws rows in the order ``torch.randperm(n)`` of a CPU
generator seeded with the training seed (accelerate's ``SeedableRandomSampler``, epoch 0), so
row ``order[p]`` is the ``p``-th drawn. Putting the long row at ``order[(step - 1) * batch +
batch // 2]`` makes it part of optimizer step ``step`` whatever the micro-batch (a rung that halves
it keeps the effective batch, so the step's rows stay the same). The bench reports the step the
OOM came at, so a different order would show.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..models import memory_grid
from ..scenarios import gpu_ladder
from .scenarios import Scenario

#: Words per short row of the long-row dataset (the counting rows of gpu_ladder add ~64 more).
SHORT_ROW_TOKENS = 96


@contextlib.contextmanager
def build_lock(cache: Path) -> Iterator[None]:
    """One builder at a time per cache: the other card commands wait here, then find the files."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".build.lock").open("w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def ensure_assets(cache: Path, scenarios: list[Scenario], tiny: bool) -> dict[str, Any]:
    """Every shape and dataset ``scenarios`` need, under ``cache``; what was built, with timings."""
    shapes = sorted({s.shape for s in scenarios})
    seq = max(s.seq for s in scenarios)
    with build_lock(cache):
        built = memory_grid.build_all(shapes, cache, tiny, seq)
        for scenario in scenarios:
            if scenario.long_row_step is not None:
                path = cache / scenario.shape / scenario.data_name
                if not path.is_file():
                    write_long_row_data(path, scenario)
                    built[scenario.data_name] = {"rows": scenario.max_steps * scenario.effective_batch}
    missing = [name for name in shapes if not (cache / name / "model" / "config.json").is_file()]
    if missing:
        raise SystemExit(f"could not build {missing} in {cache}: {json.dumps(built)[-2000:]}")
    return built


def long_row_position(rows: int, batch: int, step: int, seed: int) -> int:
    """The row index the sampler draws in the middle of optimizer ``step`` (see the module doc)."""
    import torch  # only here: the card commands never need torch once the data is written

    order = torch.randperm(rows, generator=torch.Generator().manual_seed(seed)).tolist()
    return int(order[(step - 1) * batch + batch // 2])


def write_long_row_data(path: Path, scenario: Scenario, seed: int = 42) -> int:
    """Short rows with one row longer than ``seq`` that lands in ``long_row_step``; its index."""
    from qlora_supervise.trainer_child.contract.spec import TrainSpec

    assert scenario.long_row_step is not None
    if seed != TrainSpec().seed:
        raise ValueError("the job files use the default training seed; place the row with that one")
    count = scenario.max_steps * scenario.effective_batch  # one epoch: every row is drawn once
    rows = gpu_ladder.long_rows(count, SHORT_ROW_TOKENS, seed=1)
    index = long_row_position(count, scenario.effective_batch, scenario.long_row_step, seed)
    rows[index] = gpu_ladder.long_rows(1, scenario.seq, seed=2)[0]
    with path.open("w", encoding="utf-8") as handle:
        handle.writelines(json.dumps(row) + "\n" for row in rows)
    (path.parent / f"{path.stem}.json").write_text(
        json.dumps({"long_row_index": index, "step": scenario.long_row_step, "rows": count}), encoding="utf-8"
    )
    return index
