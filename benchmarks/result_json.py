"""How the benchmarks write their JSON results: one row a line.

A result is a JSON object of a few parts (``machine``, ``rows``, ``runs``, ...), most of them lists or maps of rows.
:func:`dumps` opens the object and each part one item a line and writes everything deeper on that item's line, so a
rerun's diff shows the rows that moved, and a result of thousands of numbers stays a few hundred lines. It is valid
JSON, read back with ``json.loads`` as before.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["dumps", "write"]

DEPTH = 2  # the object and its parts are opened; their items are written whole, one a line


def dumps(doc: Any, default: Any = None) -> str:
    """``doc`` as JSON: the first :data:`DEPTH` levels of objects and lists one item a line, deeper ones compact on
    their item's line; a trailing newline. ``default`` as for ``json.dumps``."""

    def enc(x: Any, level: int) -> str:
        if level >= DEPTH or not isinstance(x, dict | list) or not x:
            return json.dumps(x, separators=(",", ":"), default=default)
        pad = " " * (level + 1)
        if isinstance(x, dict):
            items = [f"{pad}{_key(k)}:{enc(v, level + 1)}" for k, v in x.items()]
            return "{\n" + ",\n".join(items) + "\n" + " " * level + "}"
        items = [f"{pad}{enc(v, level + 1)}" for v in x]
        return "[\n" + ",\n".join(items) + "\n" + " " * level + "]"

    return enc(doc, 0) + "\n"


def _key(k: Any) -> str:
    """An object's key as ``json.dumps`` writes it (a number or ``None`` as a string)."""
    return json.dumps({k: 0}, separators=(",", ":"))[1:-3]


def write(path: Path, doc: Any, default: Any = None) -> Path:
    """Write ``doc`` to ``path`` with :func:`dumps`; the path."""
    path.write_text(dumps(doc, default))
    return path
