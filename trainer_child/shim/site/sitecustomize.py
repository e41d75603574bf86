"""Loaded by Python at start-up from the child's PYTHONPATH. It never breaks the tool it rides in: a
failure to attach is one line on stderr, and the user's own ``sitecustomize`` still runs."""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent


def _attach() -> None:
    spec_path = os.environ.get("QLORA_SUPERVISE_SHIM_SPEC")
    if not spec_path:
        return
    try:
        from qlora_supervise.trainer_child.shim import attach

        attach.install(spec_path)
    except Exception as exc:  # the tool runs on unsupervised rather than not at all
        print(f"qlora-supervise shim: not attached: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` (ours shadows it by coming first)."""
    for entry in sys.path:
        candidate = Path(entry or ".") / "sitecustomize.py"
        if candidate.is_file() and candidate.resolve().parent != _HERE:
            spec = importlib.util.spec_from_file_location("_qlora_supervise_next_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                spec.loader.exec_module(importlib.util.module_from_spec(spec))
            return


_attach()
_chain()
