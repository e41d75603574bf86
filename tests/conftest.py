"""Shared fixtures. The trainer-child fixtures live in ``_child.py``; registered here so the
session-scoped tiny model is built once for all test modules."""

import pytest
from _child import tiny_dir_fixture  # noqa: F401 - registers the `tiny_dir` fixture


@pytest.fixture(autouse=True)
def _peak_store_in_tmp(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every test keeps the per-host peak store in a temp dir: tests never write to ~/.local/state."""
    monkeypatch.setenv("QLORA_SUPERVISE_STATE_DIR", str(tmp_path_factory.mktemp("state")))
