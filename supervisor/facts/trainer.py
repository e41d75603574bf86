"""The trainer as every room sees it (``Job.trainer``, never None): our own child or a tool the user
runs (``supervisor/trainers/``). Callers ask it what they need, never which kind it is."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from qlora_supervise.trainer_child.contract.codes import FailureKind
from qlora_supervise.trainer_child.contract.spec import Knobs

Ladders = Mapping[FailureKind, tuple[str, ...]]
OWN = "own"


class Trainer(Protocol):
    """What the loop, the commands and the record need of the job's trainer. Each method's body is
    our own child's answer (:class:`OwnTrainer` inherits them); a tool implements every member."""

    @property
    def kind(self) -> str:
        """``own`` or the tool's kind: whose peaks and speeds the per-host store keeps apart."""

    @property
    def config_path(self) -> Path | None:
        """The user's own config file of the tool (None: ours, or an hf-script's argv)."""

    @property
    def spare(self) -> bool:
        """Whether a warm spare (a child that imported our trainer's stack) can run its attempts."""

    def config_view(self) -> dict[str, Any]:
        """The tool's config as the run's generations record it ({}: ours is the job file)."""
        return {}

    def ladders(self, overrides: Ladders) -> dict[FailureKind, tuple[str, ...]]:
        """The job's ladder overrides with only the rungs this trainer can take."""
        return dict(overrides)

    def cannot_take(self) -> frozenset[str]:
        """The rungs whose knob this trainer cannot be told."""
        return frozenset()

    def unmodelled(self, model_dir: str) -> str | None:
        """Why the memory model cannot count this trainer's base weights; None: it can."""
        return None

    def attention(self) -> str | None:
        """The attention the trainer asks transformers for (None: the model type's default)."""
        return None

    def cwd(self, job_dir: Path, run_dir: Path, command: Sequence[str]) -> Path:
        """Where an attempt's process runs: ``command`` is the spec's (empty: our own child)."""
        return run_dir

    def attempt_argv(
        self, attempt_dir: Path, run_dir: Path, job: Knobs, knobs: Knobs, resume_from: str | None
    ) -> tuple[str, ...]:
        """Write the attempt's own files and return its argv; () starts our child."""
        return ()

    def saved_alone(self, run_dir: Path) -> bool:
        """Whether the trainer saved its result where only it writes (a tool without the shim)."""
        return False

    def summary(self) -> list[str]:
        """``validate``'s lines about the trainer."""
        return []

    def model_words(self) -> tuple[str, str, str]:
        """How the job names its model: (key, where, how to set it)."""
        return ("model.path", "the job file", "model.path: DIR")

    def built_knobs(self, knobs: Knobs, run_dir: Path) -> Knobs:
        """The job's knobs as its trainer builds them (a script's, from what its attempts reported)."""
        return knobs

    def probes_data(self) -> bool:
        """Whether the supervisor reads the data file (a tool reads its own data)."""
        return True

    def service_paths(self) -> list[tuple[str, str]]:
        """(field, path) of the trainer's own files that a service must see."""
        return []


@dataclass(frozen=True)
class OwnTrainer(Trainer):
    """Our trainer child (``trainer_child/``): the job file's sections are its whole config."""

    kind: str = OWN
    config_path: Path | None = None
    spare: bool = True
