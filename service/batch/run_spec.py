"""What a run's rows come from, shared by both engines: the options a row is answered with, and the record
``run.json`` keeps (a resume must match it)."""

from __future__ import annotations

import argparse
from typing import Any

from service.batch.scorer import BatchOptions

__all__ = ["options_of", "run_record"]


def options_of(args: argparse.Namespace) -> BatchOptions:
    """The answer's options of a command line (as a ``/predict`` request would ask them)."""
    return BatchOptions(args.top_k, args.members, args.scores, args.alpha, None, args.risk)


def run_record(args: argparse.Namespace, described: dict[str, Any]) -> dict[str, Any]:
    """What the rows come from, as ``run.json`` keeps it: the model, its version, the options, the input."""
    where = {"input": str(args.input.resolve()), "column": args.column, "id_column": args.id_column}
    return {**described, **where, "record": bool(args.record)}
