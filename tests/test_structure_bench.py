"""The rooms bench (bench/structure/rooms.py): knots, cycles and hidden imports read from source."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.structure import rooms


def test_strong_components_and_cycles_find_every_circle_and_nothing_else() -> None:
    """A knot of three and a pair are found as components, with their elementary cycles; a chain is not."""
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": {"e"}, "e": {"d"}, "f": {"a"}}
    assert sorted(rooms.strong_components(edges)) == [["a", "b", "c"], ["d", "e"]]
    assert sorted(rooms.cycles(edges)) == [["a", "b", "c", "a"], ["d", "e", "d"]]
    assert rooms.strong_components({"x": {"y"}, "y": set()}) == []


def test_imports_marks_the_ones_a_function_or_type_checking_hides(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module-level import is plain, one in a function body lazy, one under TYPE_CHECKING type."""
    package = tmp_path / "supervisor" / "room"
    package.mkdir(parents=True)
    source = package / "mod.py"
    source.write_text(
        "from typing import TYPE_CHECKING\n"
        "from qlora_supervise.supervisor.room import plain\n"
        "if TYPE_CHECKING:\n    from qlora_supervise.supervisor.room.typed import X\n"
        "def f():\n    from . import lazy\n"
    )
    monkeypatch.setattr(rooms, "ROOT", tmp_path)
    known = {f"supervisor.room.{name}" for name in ("mod", "plain", "typed", "lazy")}
    assert rooms.imports(source, known) == [
        ("supervisor.room.lazy", "lazy"),
        ("supervisor.room.plain", ""),
        ("supervisor.room.typed", "type"),
    ]


def test_the_bench_reads_this_checkout() -> None:
    """Every product module is in the graph, and facts/ imports no other room."""
    graph = rooms.graph(rooms.ROOT / "supervisor")
    assert "supervisor.facts.failure" in graph
    facts = [t for m, ts in graph.items() if m.startswith("supervisor.facts") for t, _ in ts]
    assert all(rooms.room_of(t, "supervisor") in (None, "facts", "(top)") for t in facts), facts
