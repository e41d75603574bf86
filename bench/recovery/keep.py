"""The journals of a run directory, copied for keeping (``bench/results/``), checkpoints left out.

What ``qlora-supervise status`` and ``explain`` read is copied whole: ``attempts.jsonl``,
``events.jsonl``, ``state.json``, the job versions and, per attempt, ``spec.json``,
``child-events.jsonl``, ``error.json`` and ``gpu.jsonl``; ``child.log`` and anything else larger
than :data:`WHOLE_LIMIT` keep their last :data:`TAIL_BYTES` (the traceback is at the end).
Never copied: checkpoints (also quarantined or superseded ones), the adapter, merged weights,
TensorBoard files.
"""

from __future__ import annotations

import shutil
from pathlib import Path

SKIP_DIRS = ("checkpoints", "adapter", "merged", "tensorboard")
WHOLE_LIMIT = 2 << 20
TAIL_BYTES = 32 << 10


def _skipped(relative: Path) -> bool:
    return any(part.startswith(SKIP_DIRS) for part in relative.parts[:-1])


def keep_journals(run_dir: Path, keep: Path) -> list[str]:
    """Copy ``run_dir``'s journals into ``keep``; the relative paths copied."""
    copied: list[str] = []
    if not run_dir.is_dir():
        return copied
    for path in sorted(p for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink()):
        relative = path.relative_to(run_dir)
        if _skipped(relative) or path.suffix in (".safetensors", ".pt", ".bin", ".pth"):
            continue
        target = keep / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if path.stat().st_size <= WHOLE_LIMIT and path.name != "child.log":
            shutil.copyfile(path, target)
        else:
            with path.open("rb") as handle:
                size = handle.seek(0, 2)
                handle.seek(max(0, size - TAIL_BYTES))
                target.write_bytes(handle.read())
        copied.append(str(relative))
    return copied
