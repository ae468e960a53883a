"""Markdown tables: a header and rows of cells, and a table of methods whose columns are ``(header, cell)``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any


def table(header: list[str], body: list[list[str]]) -> list[str]:
    """A markdown table: the first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    return lines + ["| " + " | ".join(row) + " |" for row in body]


Cell = Callable[[Mapping[str, Any]], str]  # one table cell from a row (or from one OOD set's entry of a row)


def cell(fmt: Callable[[Any], str], key: str, required: bool = False) -> Cell:
    """``fmt`` of ``key``: a missing key shows as "–", or raises KeyError when ``required``."""
    return (lambda r: fmt(r[key])) if required else (lambda r: fmt(r.get(key)))


def method_table(columns: Sequence[tuple[str, Cell]], entries: Iterable[tuple[str, Mapping[str, Any]]]) -> list[str]:
    """A table with a "Method" column, then one column per ``(header, cell)``, one line per ``(method, entry)``."""
    return table(["Method", *(h for h, _ in columns)], [[m, *(cell(e) for _, cell in columns)] for m, e in entries])
