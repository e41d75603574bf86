"""Shared fixtures. The trainer-child fixtures live in ``_child.py``; registered here so the
session-scoped tiny model is built once for all test modules."""

from _child import tiny_dir_fixture  # noqa: F401 - registers the `tiny_dir` fixture
