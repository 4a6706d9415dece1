"""`make lint`: every function in the operator package is under LIMIT lines (docs/architecture.md).

A function's length is from its `def` line (decorators excluded) to its last line, docstring and comments
included: what a reader has to hold at once. Lists every function at or over the limit and exits 1.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LIMIT = 60
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = [ROOT / "operator" / "rlhf_operator"]


def long_functions(path: Path, limit: int) -> list[tuple[int, str, int]]:
    """(line, qualified name, length) of every function in `path` of `limit` lines or more."""
    found: list[tuple[int, str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    length = (child.end_lineno or child.lineno) - child.lineno + 1
                    if length >= limit:
                        found.append((child.lineno, name, length))
                visit(child, f"{name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text(), str(path)), "")
    return found


def main(argv: list[str]) -> int:
    limit = int(argv[0]) if argv else LIMIT
    over = [
        (path, line, name, length)
        for package in PACKAGES
        for path in sorted(package.rglob("*.py"))
        for line, name, length in long_functions(path, limit)
    ]
    for path, line, name, length in over:
        print(f"{path.relative_to(ROOT)}:{line}: {name} is {length} lines (must be under {limit})")
    if over:
        print(
            f"{len(over)} function(s) of {limit} lines or more: split them (docs/architecture.md)",
            file=sys.stderr,
        )
    return 1 if over else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
