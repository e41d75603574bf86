"""The import graph of the product's rooms, read from the source with ``ast``.

Prints, for ``supervisor/`` (or the folder given), every arrow between rooms with how many
imports make it, the rooms that import each other in one knot (strongly connected
components), the arrows that run back up the target order, and the file-level cycles,
counting the imports a function body or an ``if TYPE_CHECKING:`` block hides (marked)::

    python -m bench.structure.rooms                     # supervisor/'s rooms
    python -m bench.structure.rooms trainer_child/run   # the child's run/ (files only)
"""

from __future__ import annotations

import argparse
import ast
import collections
import itertools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"supervisor", "policies", "trainer_child"}
# Top to bottom; rooms on one line may not import each other either.
ORDER: tuple[tuple[str, ...], ...] = (
    ("commands",),
    ("loop",),
    ("diagnosis", "reporting", "trainers"),
    ("record",),
    ("jobfile",),
    ("watching",),
    ("facts",),
)


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _hidden(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    """'lazy' inside a function body, 'type' under ``if TYPE_CHECKING``, '' at module level."""
    while node in parents:
        node = parents[node]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return "lazy"
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            return "type"
    return ""


def imports(path: Path, known: set[str]) -> list[tuple[str, str]]:
    """(imported module of ours, '' | 'lazy' | 'type') for each import in *path*."""
    tree = ast.parse(path.read_text())
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    me = _module_of(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                head = ".".join(base + ([node.module] if node.module else []))
            else:
                head = node.module or ""
            # `from pkg import mod` imports pkg.mod; `from mod import Name` imports mod.
            names = [f"{head}.{alias.name}" for alias in node.names]
        for name in names:
            name = name.removeprefix("qlora_supervise.")
            # The longest module of ours that the name starts with (a name may be a class in it).
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != me:
                found.append((name, _hidden(node, parents)))
    # One entry per module: the plainest way it is imported wins.
    best: dict[str, str] = {}
    for name, how in found:
        best[name] = min(best.get(name, how), how, key=lambda h: h != "")
    return sorted(best.items())


def graph(folder: Path) -> dict[str, list[tuple[str, str]]]:
    files = sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))
    known = {_module_of(p) for p in files}
    return {
        _module_of(p): [(m, how) for m, how in imports(p, known)]
        for p in files
        if folder in p.parents or p.parent == folder
    }


def strong_components(edges: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's strongly connected components with more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def cycles(edges: dict[str, set[str]], limit: int = 50) -> list[list[str]]:
    """Elementary cycles (each once, starting at its smallest node), at most *limit*."""
    found: list[list[str]] = []
    for comp in strong_components(edges):
        members = set(comp)
        for start in comp:
            todo: list[tuple[str, list[str]]] = [(start, [start])]
            while todo and len(found) < limit:
                node, path = todo.pop()
                for nxt in sorted(edges.get(node, ())):
                    if nxt == start:
                        found.append([*path, start])
                    elif nxt in members and nxt > start and nxt not in path and len(path) < 8:
                        todo.append((nxt, [*path, nxt]))
    return found


def room_of(module: str, top: str) -> str | None:
    if not module.startswith(top + "."):
        return None
    rest = module[len(top) + 1 :].split(".")
    return rest[0] if len(rest) > 1 else "(top)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", nargs="?", default="supervisor")
    args = parser.parse_args()
    folder = ROOT / args.folder
    top = args.folder.replace("/", ".")
    g = graph(folder)
    rank = {room: i for i, line in enumerate(ORDER) for room in line}

    rooms: collections.Counter[tuple[str, str]] = collections.Counter()
    for module, targets in g.items():
        a = room_of(module, top)
        for target, _how in targets:
            b = room_of(target, top)
            if a and b and a != b and a != "(top)" and b != "(top)":
                rooms[a, b] += 1
    room_edges: dict[str, set[str]] = collections.defaultdict(set)
    for a, b in rooms:
        room_edges[a].add(b)
    if top == "supervisor":
        print("arrows between rooms (imports):")
        for (a, b), n in sorted(rooms.items()):
            back = rank.get(a, -1) >= rank.get(b, 99)
            print(f"  {a:>10} -> {b:<10} {n:3d}{'  BACK' if back else ''}")
        knots = strong_components(room_edges)
        backs = [(a, b) for a, b in rooms if rank.get(a, -1) >= rank.get(b, 99)]
        print(f"rooms in a knot: {sum(map(len, knots))} {knots}")
        print(f"arrows back up the order: {len(backs)}")

    file_edges = {m: {t for t, _ in ts if t in g} for m, ts in g.items()}
    plain_edges = {m: {t for t, how in ts if t in g and not how} for m, ts in g.items()}
    hidden = {(m, t): how for m, ts in g.items() for t, how in ts if how and t in g}
    found = cycles(file_edges)
    print(f"file cycles: {len(found)} ({len(cycles(plain_edges))} through module-level imports only)")
    for cycle in found:
        steps = [a + (f" [{hidden[a, b]}]" if (a, b) in hidden else "") for a, b in itertools.pairwise(cycle)]
        print("  " + " -> ".join(steps) + f" -> {cycle[-1]}")


if __name__ == "__main__":
    main()
