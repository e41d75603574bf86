"""The job's foreign trainer, validated: which tool, the user's config as read, how to start it."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from qlora_supervise.supervisor.record.rundir import TRAINER_OUTPUT
from qlora_supervise.supervisor.trainers.mapping import flatten
from qlora_supervise.supervisor.trainers.tables import TABLES, Table, TrainerKind

# TRAINER_OUTPUT: the tool's own output directory inside the run directory (its final save, its
# logs), created before each attempt, never through a link; our checkpoints still go to
# ``checkpoints/`` and the adapter to ``adapter/``.


@dataclass(frozen=True)
class ForeignTrainer:
    """A tool that is not ours. ``config`` is the user's file (or, for ``hf-script``, the flags of
    ``command``) as read once at load; it is never written back."""

    kind: TrainerKind
    config: Mapping[str, Any]
    config_path: Path | None = None  # None: hf-script (its config is on the command line)
    command: tuple[str, ...] = ()  # hf-script: the user's argv
    python: str = sys.executable  # the interpreter of the tool's venv
    workdir: Path | None = None  # where the tool runs (None: the job file's folder)

    @property
    def table(self) -> Table:
        return TABLES[self.kind]

    def unread_keys(self) -> dict[str, Any]:
        """The config's keys (dotted where nested) that the supervisor reads into no knob or field
        of its own (``use_cpu``, ``bf16``, ``learning_rate``): what a job's fields do not show."""
        table = self.table
        read = {key for row in table.rows for key in (row.key, *row.preferred)}
        read |= {table.max_steps_key, table.epochs_key, table.save_steps_key, table.targets_key}
        read |= {table.data_key, table.output_key, table.resume_key}
        return {key: value for key, value in flatten(self.config).items() if key not in read}

    @staticmethod
    def frozen(config: Mapping[str, Any]) -> Mapping[str, Any]:
        return MappingProxyType(dict(config))


def foreign_output(run_dir: Path) -> Path:
    """The tool's own output directory in ``run_dir`` (its final save lands there)."""
    return run_dir / TRAINER_OUTPUT


def tool_saved(run_dir: Path) -> bool:
    """Whether the tool saved anything into its output directory. The directory itself proves
    nothing: the loop creates it before every attempt of the tool."""
    output = foreign_output(run_dir)
    try:
        return output.is_dir() and any(output.iterdir())
    except OSError:  # gone or unreadable in between: nothing saved that we can read
        return False


def saved_by_the_tool_only(run_dir: Path, adapter: Path) -> Path | None:
    """The tool's output directory when it holds the result and ``adapter`` was never written (a
    foreign tool the shim did not attach to saves there alone); None otherwise."""
    return foreign_output(run_dir) if not adapter.exists() and tool_saved(run_dir) else None
