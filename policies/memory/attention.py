"""Which attention the child's transformers will run a model type with, read without importing it.

transformers picks SDPA when the model class sets ``_supports_sdpa = True``, and the flag moves
between releases (Gemma 2: True in 5.17, False in 5.24) while eager attention costs a factor of two
at seq 8192; importing the modeling module would import torch, so its source is read as text.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
from pathlib import Path

#: The transformers folder of a model type whose modeling module is named for another one.
MODULE_OF = {"gemma3_text": "gemma3"}
#: Eager where transformers' source cannot be read: the child's pinned release (5.24) says so.
EAGER_WITHOUT_SOURCE = frozenset({"gemma2"})


def default_attention(model_type: str) -> str:
    """``"sdpa"`` or ``"eager"``: what transformers picks for ``model_type`` when asked for none."""
    supports = _supports_sdpa(_transformers_root(), MODULE_OF.get(model_type, model_type))
    if supports is None:
        return "eager" if model_type in EAGER_WITHOUT_SOURCE else "sdpa"
    return "sdpa" if supports else "eager"


def _transformers_root() -> Path | None:
    return installed_package_root("transformers")


@functools.cache
def installed_package_root(name: str) -> Path | None:
    """The installed package's folder, found without importing it (its source is read as text)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def _supports_sdpa(root: Path | None, module: str) -> bool | None:
    """``_supports_sdpa`` of ``models/<module>/modeling_<module>.py``'s ``*PreTrainedModel`` class;
    None when that file cannot be read; False when it sets nothing (``PreTrainedModel``'s default)."""
    if root is None:
        return None
    path = root / "models" / module / f"modeling_{module}.py"
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    return bool(supports_sdpa_in(tree))


def supports_sdpa_in(tree: ast.Module) -> bool | None:
    """The constant a ``*PreTrainedModel`` class in ``tree`` assigns to ``_supports_sdpa``."""
    for node in tree.body:
        if not (isinstance(node, ast.ClassDef) and node.name.endswith("PreTrainedModel")):
            continue
        for statement in node.body:
            value: ast.expr | None
            if isinstance(statement, ast.Assign):
                targets, value = statement.targets, statement.value
            elif isinstance(statement, ast.AnnAssign):
                targets, value = [statement.target], statement.value
            else:
                continue
            named = any(isinstance(t, ast.Name) and t.id == "_supports_sdpa" for t in targets)
            if named and isinstance(value, ast.Constant) and isinstance(value.value, bool):
                return value.value
    return None
