"""Numbers as the report shows them: cells of report.md (percentages, counts, temperatures) and strict JSON values.

A missing or non-finite number shows as "–" in a cell and as ``null`` in JSON (strict JSON has no NaN).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np


def jsonable(x: Any) -> Any:
    """Plain JSON values: numpy scalars/arrays to Python, NaN/inf to None (strict JSON has no NaN)."""
    if isinstance(x, Mapping):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, np.ndarray):
        return jsonable(x.tolist())
    if isinstance(x, (np.bool_, bool)):
        return bool(x)
    if isinstance(x, (np.integer, int)):
        return int(x)
    if isinstance(x, (np.floating, float)):
        return float(x) if math.isfinite(x) else None
    if isinstance(x, Path):
        return str(x)
    return x


def pct(x: Any) -> str:
    """A fraction as a percentage with two decimals ("12.34")."""
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{100 * x:.2f}"


def num(x: Any, digits: int = 4) -> str:
    """A number with ``digits`` decimals (NLL, Brier, entropies, MI)."""
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def param_count(n: Any) -> str:
    """A parameter count: millions from 100k up ("1.23M"), else the count ("12,345")."""
    return "–" if n is None else f"{n / 1e6:.2f}M" if n >= 1e5 else f"{int(n):,}"


def latency_cell(r: dict, key: str) -> str:
    """The latency of row ``r`` at ``key`` (``batch1``, ``batch8``): "median (min)" ms."""
    v = r.get("latency_ms", {}).get(key)
    return "–" if not v else f"{v['median_ms']:.1f} ({v['min_ms']:.1f})"


def sig4(x: Any) -> str:
    """A temperature or an OOD threshold (in its score's own units): up to 4 significant digits ("1", "1.237")."""
    return "–" if x is None or not math.isfinite(x) else f"{x:.4g}"


def finite(x: Any) -> bool:
    """Whether ``x`` is a finite number (not None, NaN or inf)."""
    return isinstance(x, (int, float, np.integer, np.floating)) and math.isfinite(x)


def fact_text(v: Any) -> str:
    """A build fact: floats to 6 significant digits, anything else as its JSON value."""
    if isinstance(v, (float, np.floating)):
        return f"{float(v):.6g}"
    return str(jsonable(v))
