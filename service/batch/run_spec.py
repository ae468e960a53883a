"""What a run's rows come from, shared by both engines: the options a row is answered with, the record ``run.json``
keeps (a resume must match it), and the artifact's guarantees read without loading its model."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from service.batch.scorer import BatchOptions
from service.core.artifact import load_manifest
from service.core.guarantees import load_guarantees

__all__ = ["guarantees_of", "options_of", "run_record"]


def options_of(args: argparse.Namespace) -> BatchOptions:
    """The answer's options of a command line (as a ``/predict`` request would ask them)."""
    return BatchOptions(args.top_k, args.members, args.scores, args.alpha, None, args.risk)


def run_record(args: argparse.Namespace, described: dict[str, Any]) -> dict[str, Any]:
    """What the rows come from, as ``run.json`` keeps it: the model, its version, the options, the input."""
    where = {"input": str(args.input.resolve()), "column": args.column, "id_column": args.id_column}
    return {**described, **where, "record": bool(args.record)}


def guarantees_of(artifact: Path) -> tuple[Any, str]:
    """The artifact's guarantees and served OOD score, without loading its model (a Ray run's driver)."""
    manifest = load_manifest(artifact)
    return load_guarantees(artifact, manifest), manifest.uncertainty.ood_score
