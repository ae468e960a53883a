"""JSON Lines read alike by the builder (a user's data file) and ``hydra-predict`` (a batch's input): each non-blank
line one JSON object, a line that is not one named by its number."""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

__all__ = ["json_objects"]


def json_objects(lines: Iterable[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(line number from 1, object)`` of every non-blank line; ``ValueError`` naming the first line that is not
    valid JSON, or not a JSON object."""
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"line {lineno} is not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"line {lineno} is not a JSON object")
        yield lineno, obj
