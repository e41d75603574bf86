"""The shape of the code, as the shape issue measures it: lines per module, longest functions,
typed share and docstring share of functions, and the comment share of lines.

    python bench/code_shape.py [--top 10] [--ref REV]

``--ref`` measures a git revision instead of the work tree (``git archive`` into a temp dir).
Not a test.
"""

from __future__ import annotations

import argparse
import ast
import io
import subprocess
import tarfile
import tempfile
import tokenize
from pathlib import Path

PACKAGES = ("supervisor", "policies", "trainer_child")


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _typed(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    args = [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]
    params = [a for a in args if a.arg not in ("self", "cls")]
    return fn.returns is not None and all(a.annotation is not None for a in params)


def _comment_lines(source: str) -> int:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return sum(1 for tok in tokens if tok.type == tokenize.COMMENT)


def measure(root: Path, top: int) -> None:
    modules, functions = [], []
    comments = total_lines = 0
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            source = path.read_text(encoding="utf-8")
            lines = source.count("\n")
            total_lines += lines
            comments += _comment_lines(source)
            modules.append((lines, str(path.relative_to(root))))
            for fn in _functions(ast.parse(source)):
                length = (fn.end_lineno or fn.lineno) - fn.lineno + 1
                functions.append(
                    (length, f"{path.relative_to(root)}:{fn.name}", _typed(fn), bool(ast.get_docstring(fn)))
                )
    sup = [m for m in modules if m[1].startswith("supervisor/")]
    print(f"modules: {len(modules)} ({len(sup)} in supervisor/), lines: {total_lines}")
    print("largest supervisor modules: " + ", ".join(f"{n} {p}" for n, p in sorted(sup, reverse=True)[:top]))
    print(
        "longest functions: "
        + ", ".join(f"{n} {name}" for n, name, _, _ in sorted(functions, reverse=True)[:top])
    )
    typed = sum(1 for f in functions if f[2])
    documented = sum(1 for f in functions if f[3])
    count = len(functions)
    print(f"functions: {count}, fully typed {typed / count:.0%}, with docstring {documented / count:.0%}")
    print(f"comment lines: {comments} ({comments / total_lines:.1%} of lines)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=8)
    parser.add_argument("--ref", default=None)
    args = parser.parse_args()
    if args.ref is None:
        measure(Path(__file__).resolve().parent.parent, args.top)
        return
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "archive", args.ref], check=True, capture_output=True).stdout
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(tmp, filter="data")
        measure(Path(tmp), args.top)


if __name__ == "__main__":
    main()
