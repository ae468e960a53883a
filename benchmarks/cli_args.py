"""The benchmarks' shared command-line checks: counts that must be positive, refused in one line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path


def parse_positive(p: argparse.ArgumentParser, argv: Sequence[str] | None, *names: str) -> argparse.Namespace:
    """``p``'s arguments from ``argv``; ``p.error`` (exit 2, one line) when one of ``names`` is below 1."""
    args = p.parse_args(argv)
    low = [f"--{n.replace('_', '-')}" for n in names if getattr(args, n) < 1]
    if low:
        p.error(f"{' and '.join(low)} must be >= 1")
    return args


def parser(doc: str | None, default_out: str) -> argparse.ArgumentParser:
    """A benchmark's parser: its description (the docstring's first paragraph) and ``--out`` (its result file)."""
    p = argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])
    p.add_argument("--out", type=Path, default=None, help=f"result file (default {default_out})")
    return p
