"""The environment of a foreign trainer's process: the shim on its PYTHONPATH (found beside the
contract's entry module; nothing of it is imported here), the spec named."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from qlora_supervise.trainer_child.contract import entry
from qlora_supervise.trainer_child.contract.spec import AttemptSpec

#: The same name as trainer_child.shim.SHIM_SPEC_ENV (tests/test_trainer_shim.py checks they agree).
SHIM_SPEC_ENV = "QLORA_SUPERVISE_SHIM_SPEC"
SHIM_SITE = Path(entry.__file__).resolve().parent.parent / "shim" / "site"


def trainer_env(env: Mapping[str, str], spec: AttemptSpec, spec_path: Path) -> dict[str, str]:
    """``env`` plus the shim for a foreign attempt (``spec.command`` set); unchanged for ours."""
    out = dict(env)
    if not spec.command:
        return out
    path = out.get("PYTHONPATH", "")
    out["PYTHONPATH"] = os.pathsep.join(p for p in (str(SHIM_SITE), path) if p)
    out[SHIM_SPEC_ENV] = str(spec_path)
    # It runs in the user's folder: no __pycache__ written beside the modules it imports from there.
    out["PYTHONDONTWRITEBYTECODE"] = "1"
    return out
