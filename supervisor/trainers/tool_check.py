"""Whether the tool, and the shim, can be imported by the interpreter that will run them (``find_spec``
there, once per interpreter): a missing tool fails every start; without qlora-supervise, no shim."""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

from qlora_supervise.supervisor.facts.trainer import Trainer
from qlora_supervise.supervisor.jobfile.advice import Advice
from qlora_supervise.supervisor.jobfile.problems import Problem, show
from qlora_supervise.supervisor.trainers.trainer import ToolTrainer

SHIM_PACKAGE = "qlora_supervise"
_PROBE = (
    "import importlib.util, sys; "
    "print(' '.join(n for n in sys.argv[1:] if importlib.util.find_spec(n) is None))"
)


def tool_problems(trainer: Trainer) -> list[Problem]:
    """The tool's package missing for its interpreter, with the fix; [] when it is there, for our
    own trainer, or when the interpreter could not be asked (the attempt will say what is wrong)."""
    if not isinstance(trainer, ToolTrainer):
        return []
    package, python = trainer.tool.package, trainer.python
    if package is None or package not in _missing(trainer, python):
        return []
    why = f"{package} is not installed for this interpreter: the tool would fail on every start"
    fix = (
        f"install it there (`{python} -m pip install {package}`), or name the python of "
        "the venv it is in (trainer.python)"
    )
    return [Problem("trainer.python", why, show(python), fix)]


def tool_advice(trainer: Trainer) -> list[Advice]:
    """What validate warns of and run says at start about a tool: no shim in its interpreter, and
    each old key name the tool would drop without a word (its value then unused)."""
    if not isinstance(trainer, ToolTrainer):
        return []
    found = []
    python = _interpreter(trainer)
    if python is not None and SHIM_PACKAGE in _missing(trainer, python):
        what = (
            f"qlora-supervise is not importable by {python}, so the shim cannot attach in the "
            "tool's process: no heartbeats, error reports or checkpoints of ours, each restart at step 0"
        )
        fix = (
            f"install it there without its dependencies: `{python} -m pip install --no-deps qlora-supervise`"
        )
        found.append(Advice("trainer.python", what, fix))
    where = trainer.config_path.name if trainer.config_path is not None else "trainer.command"
    for old, new in trainer.tool.table.renamed.items():
        if old in trainer.config:
            what = (
                f"{trainer.kind} no longer reads {old} and drops it silently, so it runs with "
                f"{new}'s value (or its default) instead"
            )
            both = f" (both are set: delete {old})" if new in trainer.config else ""
            found.append(Advice(f"{where}: {old}", what, f"rename it to {new}{both}"))
    return found


def _interpreter(trainer: ToolTrainer) -> str | None:
    """The python the tool runs in: ``trainer.python``, or a script's first word where it is a
    python (a script started by another program is that program's business)."""
    if trainer.tool.entry:
        return trainer.python
    first = trainer.command[0] if trainer.command else ""
    found = shutil.which(first)
    return found if found is not None and Path(first).name.startswith("python") else None


def _missing(trainer: ToolTrainer, python: str) -> frozenset[str]:
    """Which of the tool's package and ours ``python`` cannot find, asked once from the folder the
    tool runs in and with the PYTHONPATH it inherits (both decide what it finds: the cache's key)."""
    packages = tuple(p for p in (trainer.tool.package, SHIM_PACKAGE) if p)
    workdir = str(trainer.workdir) if trainer.workdir is not None else None
    return _missing_cached(python, packages, workdir, os.environ.get("PYTHONPATH", ""))


@functools.cache
def _missing_cached(
    python: str, packages: tuple[str, ...], workdir: str | None, _pythonpath: str
) -> frozenset[str]:
    try:
        done = subprocess.run(
            [python, "-c", _PROBE, *packages],
            capture_output=True,
            stdin=subprocess.DEVNULL,
            cwd=workdir,
            text=True,
            timeout=60,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()  # not asked: the attempt itself will say what is wrong
    return frozenset(done.stdout.split()) & set(packages) if done.returncode == 0 else frozenset()
