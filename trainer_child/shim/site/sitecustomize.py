"""Loaded by Python at start-up from the child's PYTHONPATH. It never breaks the tool it rides in: a
failure to attach is one line on stderr, and the user's own ``sitecustomize`` still runs."""

import importlib.util
import os
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent

if os.environ.get("QLORA_SUPERVISE_SHIM_SPEC"):
    try:
        from qlora_supervise.trainer_child.shim import attach

        attach.install(os.environ["QLORA_SUPERVISE_SHIM_SPEC"])
    except Exception as exc:  # the tool runs on unsupervised rather than not at all
        print(f"qlora-supervise shim: not attached: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)

# The next ``sitecustomize`` on ``sys.path`` (ours shadows it by coming first) runs after ours.
for _entry in sys.path:
    _candidate = Path(_entry or ".") / "sitecustomize.py"
    if _candidate.is_file() and _candidate.resolve().parent != _HERE:
        _spec = importlib.util.spec_from_file_location("_qlora_supervise_next_sitecustomize", _candidate)
        if _spec is not None and _spec.loader is not None:
            _spec.loader.exec_module(importlib.util.module_from_spec(_spec))
        break
