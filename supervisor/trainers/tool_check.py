"""Whether the tool, and the shim, can be imported by the interpreter that will run them.

Checked by ``validate`` and at ``run``'s start, before any attempt: a tool that is not installed
for ``trainer.python`` fails in the same way on every start (``No module named 'axolotl'``), so
retrying it unchanged would only walk the run into a crash loop. A venv without qlora-supervise
still trains, but the shim cannot attach there (no heartbeats, no checkpoints of ours: every
restart begins at step 0), which a person should hear before a night's run, not in the morning.

The check asks the interpreter for the packages' import specs (``importlib.util.find_spec`` of the
top-level names: nothing is imported, about 50 ms), once per interpreter.
"""

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
PROBE_TIMEOUT_S = 60


def tool_problems(trainer: Trainer) -> list[Problem]:
    """The tool's package missing for its interpreter, with the fix; [] when it is there, for our
    own trainer, or when the interpreter could not be asked (the attempt will say what is wrong)."""
    if not isinstance(trainer, ToolTrainer):
        return []
    package = trainer.tool.package
    if package is None or package not in _missing(trainer, trainer.python):
        return []
    return [
        Problem(
            "trainer.python",
            f"{package} is not installed for this interpreter: the tool would fail on every start",
            show(trainer.python),
            f"install it there (`{trainer.python} -m pip install {package}`), or name the python of "
            "the venv it is in (trainer.python)",
        )
    ]


def shim_advice(trainer: ToolTrainer) -> list[Advice]:
    """A warning when qlora-supervise cannot be imported by the tool's interpreter (no shim)."""
    python = _interpreter(trainer)
    if python is None or SHIM_PACKAGE not in _missing(trainer, python):
        return []
    return [
        Advice(
            "trainer.python",
            f"qlora-supervise is not importable by {python}, so the shim cannot attach in the "
            "tool's process: no heartbeats, error reports or checkpoints of ours, each restart at step 0",
            f"install it there without its dependencies: `{python} -m pip install --no-deps qlora-supervise`",
        )
    ]


def tool_advice(trainer: Trainer) -> list[Advice]:
    """What validate warns of and run says at start about a tool: the shim, old key names."""
    if not isinstance(trainer, ToolTrainer):
        return []
    return [*shim_advice(trainer), *renamed_advice(trainer)]


def renamed_advice(trainer: ToolTrainer) -> list[Advice]:
    """A warning for each old key name the tool would drop without a word (its value then unused)."""
    where = trainer.config_path.name if trainer.config_path is not None else "trainer.command"
    return [
        Advice(
            f"{where}: {old}",
            f"{trainer.kind} no longer reads {old} and drops it silently, so it runs with "
            f"{new}'s value (or its default) instead",
            f"rename it to {new}" + (f" (both are set: delete {old})" if new in trainer.config else ""),
        )
        for old, new in trainer.tool.table.renamed.items()
        if old in trainer.config
    ]


def _interpreter(trainer: ToolTrainer) -> str | None:
    """The python the tool runs in: ``trainer.python``, or a script's first word where it is a
    python (a script started by another program is that program's business)."""
    if trainer.tool.entry:
        return trainer.python
    first = trainer.command[0] if trainer.command else ""
    found = shutil.which(first)
    return found if found is not None and Path(first).name.startswith("python") else None


def _missing(trainer: ToolTrainer, python: str) -> frozenset[str]:
    """Which of the tool's package and ours ``python`` cannot find, asked once, from the folder the
    tool runs in (``-c`` puts it on sys.path, as the tool's start puts its own) and with the
    PYTHONPATH it inherits: both decide what it finds, so both are in the cache's key."""
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
            timeout=PROBE_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return frozenset()  # not asked: the attempt itself will say what is wrong
    if done.returncode != 0:
        return frozenset()
    return frozenset(done.stdout.split()) & set(packages)
