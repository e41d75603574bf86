"""How a bench starts one of its own modules again in a child process.

Every bench runs as ``python -m bench.<group>.<name>`` from the repository root, and its child
processes start the same way (``-m`` puts the working directory first on their path). A child
started in another working directory gets the root on its ``PYTHONPATH`` (:func:`env_with_root`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from importlib.machinery import ModuleSpec
from pathlib import Path

#: The repository root: the folder that holds ``bench/``.
ROOT = Path(__file__).resolve().parents[1]


def module_argv(spec: ModuleSpec | None, python: str = sys.executable) -> list[str]:
    """``[python, "-m", "bench.<group>.<name>"]`` for the module whose ``__spec__`` is given."""
    if spec is None:
        raise SystemExit("run the bench as `python -m bench.<group>.<name>` from the repository root")
    return [python, "-m", spec.name]


def env_with_root(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with the repository root first on ``PYTHONPATH``."""
    out = dict(os.environ if env is None else env)
    rest = [p for p in out.get("PYTHONPATH", "").split(os.pathsep) if p and p != str(ROOT)]
    out["PYTHONPATH"] = os.pathsep.join([str(ROOT), *rest])
    return out
