"""The contract's walls: who may import what, read from the source (no imports run)."""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHILD = "qlora_supervise.trainer_child"
CONTRACT = f"{CHILD}.contract"
#: The design's limit on a product module (ARCHITECTURE.md, STYLE.md: small modules in rooms).
MAX_LINES = 400


def _package(path: Path) -> str:
    return "qlora_supervise." + ".".join(path.relative_to(ROOT).parent.parts)


def _imports(path: Path, package: str | None = None, top_level_only: bool = False) -> Iterator[str]:
    """Every module an ``import`` or ``from … import`` in ``path`` (a module of ``package``) names,
    resolved to its full name."""
    package = package or _package(path)
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in tree.body if top_level_only else ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, node.module] if node.module else base)
            yield module
            # ``from pkg import mod`` names a module too
            yield from (f"{module}.{alias.name}" for alias in node.names)


def _sources(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", ["supervisor", "policies"])
def test_supervisor_and_policies_reach_the_child_only_through_its_contract(folder: str) -> None:
    """supervisor/ and policies/ import nothing of trainer_child/ but trainer_child.contract."""
    wrong = {
        f"{path.relative_to(ROOT)}: {module}"
        for path in _sources(folder)
        for module in _imports(path)
        if module.startswith(CHILD + ".")
        and not module.startswith(CONTRACT)
        # ``from qlora_supervise.trainer_child.contract import processes`` also yields the package itself
        and module != CHILD
    }
    assert not wrong, sorted(wrong)


def test_the_contract_holds_only_the_standard_library() -> None:
    """trainer_child/contract imports the standard library, pydantic and itself; pyarrow only lazily."""
    # Parquet rows are checked the same way by `validate` and by the child (data_rows.py), so the
    # reader needs pyarrow there, imported inside the parquet function only: importing the
    # contract never loads it.
    lazy_allowed = {"pyarrow"}
    stdlib = sys.stdlib_module_names
    wrong = set()
    for path in _sources("trainer_child/contract"):
        module_level = {m for m in _imports(path, top_level_only=True)}
        for module in _imports(path):
            if module.split(".")[0] in stdlib or module.startswith(CONTRACT) or module == "__future__":
                continue
            if module.split(".")[0] == "pydantic":  # the codecs of the spec, events and report
                continue
            if module.split(".")[0] in lazy_allowed and module not in module_level:
                continue
            wrong.add(f"{path.relative_to(ROOT)}: {module}")
    assert not wrong, sorted(wrong)


def test_the_checks_see_a_wrong_import(tmp_path: Path) -> None:
    """The walker resolves relative and absolute imports, so the two tests above can fail."""
    sample = tmp_path / "probe.py"
    sample.write_text("from ..facts import units\nfrom qlora_supervise.trainer_child.run import attempt\n")
    found = set(_imports(sample, "qlora_supervise.supervisor.loop"))
    assert "qlora_supervise.supervisor.facts.units" in found
    assert "qlora_supervise.trainer_child.run.attempt" in found


def test_no_product_module_passes_the_line_limit() -> None:
    """No module of the three packages is over 400 lines: a longer one is split by concern."""
    long = {
        f"{path.relative_to(ROOT)}: {n}"
        for path in _sources("supervisor", "policies", "trainer_child")
        if (n := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert not long, sorted(long)
