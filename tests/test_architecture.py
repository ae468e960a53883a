"""The structure rules a newcomer can rely on, checked: short functions in ``service/`` and ``offline/``.

(Import rules, one-way ``offline -> service`` and no cycles, are import-linter contracts in
``pyproject.toml``, run by ``make test`` as ``lint-imports``.)
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_LINES = 80
# model forward passes stay whole: each is one read from input to output, with a shape comment per step
EXEMPT = frozenset({"forward", "_forward"})


def long_functions(packages: tuple[str, ...] = ("service", "offline"), limit: int = MAX_LINES) -> list[str]:
    """``path:line name (n lines)`` of every function longer than ``limit`` lines (decorators excluded)."""
    out = []
    for pkg in packages:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name not in EXEMPT:
                    n = node.end_lineno - node.lineno + 1
                    if n > limit:
                        out.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    return out


def test_no_function_in_service_or_offline_is_longer_than_80_lines():
    assert long_functions() == []
