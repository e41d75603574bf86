"""Each attempt's config in the tool's own format, in the attempt's directory, and its argv.

Written by the supervisor before the spawn (``loop/prepare.py``), beside ``spec.json``:

* ``trl-sft.yaml`` / ``axolotl.yaml`` / ``llamafactory.yaml``: the user's config with the ladder's
  changes, the tool's output dir (``<run>/trainer-output``) and the checkpoint to resume from;
  ``hf-script``: ``command.json``, the script's argv with its flags changed the same way;
* ``trainer-config.diff``: one ``key: old -> new`` line per key that differs from the user's
  file, which ``status`` prints under the attempt.

The user's file is read once, when the job is loaded, and never written.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from qlora_supervise.supervisor.trainers import flags
from qlora_supervise.supervisor.trainers.foreign import ForeignTrainer, foreign_output
from qlora_supervise.supervisor.trainers.mapping import attempt_config, config_diff, flatten, unmapped_changes
from qlora_supervise.supervisor.trainers.tables import TrainerKind
from qlora_supervise.trainer_child.contract.durable import write_text_atomic
from qlora_supervise.trainer_child.contract.spec import Knobs

CONFIG_NAMES = {
    TrainerKind.TRL_SFT: "trl-sft.yaml",
    TrainerKind.AXOLOTL: "axolotl.yaml",
    TrainerKind.LLAMAFACTORY: "llamafactory.yaml",
}
COMMAND_NAME = "command.json"
DIFF_NAME = "trainer-config.diff"


class UnmappedKnobsError(RuntimeError):
    """The policy changed a knob the tool's config has no key for: a bug of the supervisor (the
    rungs the tool cannot take are never chosen), raised rather than journalled as if it ran."""


def tool_argv(trainer: ForeignTrainer, config: Path) -> list[str]:
    """How the tool is started on ``config``: its own entry module, in one process, with the
    interpreter of its venv (``trl sft`` itself would go through ``accelerate launch``)."""
    python = trainer.python
    if trainer.kind is TrainerKind.TRL_SFT:
        return [python, "-m", "trl.scripts.sft", "--config", str(config)]
    if trainer.kind is TrainerKind.AXOLOTL:
        return [python, "-m", "axolotl.cli.train", str(config)]
    if trainer.kind is TrainerKind.LLAMAFACTORY:
        return [python, "-m", "llamafactory.launcher", str(config)]
    raise ValueError(f"{trainer.kind.value} has no config file")


def write_attempt_files(
    trainer: ForeignTrainer,
    attempt_dir: Path,
    run_dir: Path,
    job: Knobs,
    knobs: Knobs,
    resume_from: str | None,
) -> tuple[str, ...]:
    """Write the attempt's config (or argv) and its diff; return the argv that runs it.

    Raises :class:`UnmappedKnobsError` when ``knobs`` change what the tool cannot be told.
    """
    unmapped = unmapped_changes(trainer.table, trainer.config, job, knobs)
    if unmapped:
        raise UnmappedKnobsError(
            f"internal error: the attempt changes {', '.join(unmapped)}, which {trainer.kind.value} "
            "has no config key for; the tool would train as before while the journal said otherwise"
        )
    config = attempt_config(
        trainer.table, trainer.config, job, knobs, str(foreign_output(run_dir)), resume_from
    )
    diff = config_diff(trainer.config, config)
    write_text_atomic(attempt_dir / DIFF_NAME, "".join(f"{line}\n" for line in diff))
    if trainer.kind is TrainerKind.HF_SCRIPT:
        old, new = flatten(trainer.config), flatten(config)
        changes = {key: new.get(key) for key in {*old, *new} if old.get(key) != new.get(key)}
        argv = flags.with_flags(trainer.command, changes)
        write_text_atomic(attempt_dir / COMMAND_NAME, json.dumps(argv, indent=2) + "\n")
        return tuple(argv)
    path = attempt_dir / CONFIG_NAMES[trainer.kind]
    header = f"# qlora-supervise wrote this for one attempt from {trainer.config_path}: edit that file\n"
    write_text_atomic(path, header + yaml.safe_dump(config, sort_keys=False, allow_unicode=True))
    return tuple(tool_argv(trainer, path))


def read_diff(attempt_dir: Path) -> list[str] | None:
    """The attempt's diff lines (None: not a foreign attempt, or unreadable)."""
    try:
        return (attempt_dir / DIFF_NAME).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError):
        return None
