""":func:`install`, run in ``sitecustomize``: the environment our child fixes before torch, and a
finder that patches ``Trainer`` once ``transformers.trainer`` loads (so the tool's other processes,
launchers and data workers, stay free of torch and of our heartbeats)."""

from __future__ import annotations

import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from qlora_supervise.trainer_child.contract.script_knobs import ScriptChanges
from qlora_supervise.trainer_child.contract.spec import AttemptSpec
from qlora_supervise.trainer_child.shim import script

TRAINER_MODULE = "transformers.trainer"


@dataclasses.dataclass(eq=False)
class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds ``name`` through the other finders, and runs ``then`` on the module once it has loaded."""

    name: str
    then: Callable[[ModuleType], None]

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once: the real finders find it, we only follow the load
        if (spec := importlib.util.find_spec(fullname)) is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        original = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            original(module)
            self.then(module)

        loader.exec_module = exec_module
        return spec


#: Set once the environment is fixed (a child process inherits it, its card already narrowed).
PREPARED_ENV = "QLORA_SUPERVISE_SHIM_PREPARED"
#: The pid holding the attempt's session: a process it starts (a data worker) is not the attempt.
SESSION_ENV = "QLORA_SUPERVISE_SHIM_SESSION"


def install(spec_path: str) -> None:
    """Fix the environment for the attempt's spec and wait for ``transformers.trainer``."""
    if _started_by_the_attempt():
        return
    spec = AttemptSpec.from_json(Path(spec_path).read_text(encoding="utf-8"))
    from qlora_supervise.trainer_child.__main__ import prepare_env

    if not os.environ.get(PREPARED_ENV):  # a launcher above us (accelerate, a wrapper) did it
        prepare_env(spec)  # before torch: CUDA reads the allocator settings once
        os.environ[PREPARED_ENV] = "1"
    changes = ScriptChanges.read(Path(spec_path).parent)  # a script's: its knobs patched in (:mod:`.script`)
    ledger = None if changes is None else script.Ledger(changes, spec.knobs)
    for name, then in script.patches(ledger).items() if ledger is not None else ():
        _after_import(name, then)

    def patch(module: ModuleType) -> None:
        from qlora_supervise.trainer_child.shim.session import Session

        if _started_by_the_attempt():
            return
        os.environ[SESSION_ENV] = str(os.getpid())
        Session(spec, ledger).patch(module.Trainer)

    _after_import(TRAINER_MODULE, patch)


def _after_import(name: str, then: Callable[[ModuleType], None]) -> None:
    if name in sys.modules:  # imported before us (a sitecustomize that ran first)
        then(sys.modules[name])
    else:
        sys.meta_path.insert(0, _AfterImport(name, then))


def _started_by_the_attempt() -> bool:
    """Whether another process holds the session (a re-executed process keeps its pid)."""
    owner = os.environ.get(SESSION_ENV)
    return bool(owner) and owner != str(os.getpid())
