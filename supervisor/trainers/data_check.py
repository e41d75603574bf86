"""What a tool's config says about its data that fails the same way on every start, named at
``validate``: LLaMA-Factory's dataset names, which it looks up in ``dataset_dir/dataset_info.json``
(read from the folder the tool runs in)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from qlora_supervise.supervisor.jobfile.bounds import json_loads
from qlora_supervise.supervisor.jobfile.problems import Problem, show
from qlora_supervise.supervisor.trainers.tables import TrainerKind

#: LLaMA-Factory's data/parser.py: its default folder, the file in it, and the folder values that
#: name the hub instead.
_LF_DIR, _LF_INFO, _LF_HUB = "data", "dataset_info.json", ("ONLINE", "REMOTE:")


def data_problems(kind: TrainerKind, config: Mapping[str, Any], where: str, workdir: Path) -> list[Problem]:
    """Problems of the tool's data keys that the tool would stop on at load (none for a kind not checked)."""
    if kind is not TrainerKind.LLAMAFACTORY:
        return []
    tokenized = config.get("tokenized_path")
    if isinstance(tokenized, str) and (workdir / tokenized).is_dir():  # saved already: loaded from there
        return []
    names = [*_names(config.get("dataset")), *_names(config.get("eval_dataset"))]
    folder = config.get("dataset_dir", _LF_DIR)
    if not names or not isinstance(folder, str) or folder.startswith(_LF_HUB):
        return []
    info = workdir / folder / _LF_INFO
    try:
        known = json_loads(info.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return [
            Problem(
                f"{where}: dataset_dir",
                f"LLaMA-Factory looks up its datasets ({', '.join(names)}) in {info}, which it cannot read "
                f"({type(exc).__name__})",
                show(folder),
                "set dataset_dir to the folder that holds dataset_info.json (LLaMA-Factory's examples "
                "expect its repository's data/), or trainer.workdir to where you run llamafactory-cli",
            )
        ]
    missing = [name for name in names if not isinstance(known, dict) or name not in known]
    return [
        Problem(
            f"{where}: dataset",
            f"not defined in {info}",
            show(name),
            "add it to dataset_info.json, or name one of its datasets",
        )
        for name in missing
    ]


def _names(value: Any) -> list[str]:
    """LLaMA-Factory's dataset value: a comma-separated string (or a YAML list) of names."""
    if isinstance(value, str):
        return [name.strip() for name in value.split(",") if name.strip()]
    if isinstance(value, list):
        return [str(name).strip() for name in value if str(name).strip()]
    return []
