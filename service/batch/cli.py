"""``hydra-predict`` (``python -m service.batch``): score a folder, CSV, JSONL or Parquet file with an artifact, every
row with the fields of ``/predict``, in-process by default or on Ray Data (``--engine ray``); docs/batch.md.

Settings come from the same ``HYDRA_*`` variables as the server's (device, backend, precision, threads,
``HYDRA_DRIFT_POLICY``). Exit status: 0 done; 2 a bad argument, input or artifact (one line on stderr).
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from service.batch.inputs import BatchInputError, open_source
from service.batch.parts import FORMATS, Parts
from service.batch.ray_engine import run_ray
from service.batch.run_spec import options_of, run_record
from service.batch.scorer import BatchScorer
from service.batch.summary import SELECT_BY, batch_shift_test, label_free, select, suspend
from service.core.errors import ServiceError
from service.core.progress import bar, set_enabled
from service.settings import Settings, settings_errors

__all__ = ["finish", "main", "parse_args", "run_local"]

log = logging.getLogger("hydra.batch")
SUMMARY_COLUMNS = ("id", "error", "confidence", "ood_score", "ood_p_value", "ood_flag", "accept")
SELECT_COLUMNS = (
    "id",
    "error",
    "label",
    "confidence",
    "mutual_information",
    "margin",
    "entropy",
    "ood_score",
    "ood_p_value",
)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hydra-predict", description=__doc__.split("\n\n")[0])
    p.add_argument("input", type=Path, help="a folder of images, or a .csv, .jsonl or .parquet file")
    p.add_argument("--artifact", type=Path, required=True, help="the artifact to score with")
    p.add_argument("--out", type=Path, required=True, help="output folder: the parts, run.json, summary.json")
    p.add_argument("--column", help="a table's text column (text models) or image-path column (image models)")
    p.add_argument("--id-column", help="a table's id column (default: the row number)")
    p.add_argument("--format", default="parquet", choices=FORMATS, help="the parts' format")
    p.add_argument("--part-size", type=int, default=10_000, help="rows per part (a restart skips complete parts)")
    p.add_argument("--batch-size", type=int, default=64, help="inputs per model pass")
    p.add_argument("--threads", type=int, default=2, help="decoding threads (run beside the model)")
    p.add_argument("--top-k", type=int, default=5)
    p.add_argument("--members", action="store_true", help="each member's answer in `answer`")
    p.add_argument("--scores", action="store_true", help="every OOD score in `answer`")
    p.add_argument("--alpha", type=float, help="the prediction sets' miscoverage (default: the model's)")
    p.add_argument("--risk", type=float, help="the risk target of accept (default: the model's)")
    p.add_argument("--shift-alpha", type=float, default=0.01, help="level of the batch's shift test")
    p.add_argument("--select", type=int, default=0, metavar="K", help="write the K inputs to label first")
    p.add_argument("--by", default="mutual_information", choices=SELECT_BY, help="what --select ranks by")
    p.add_argument("--engine", default="local", choices=("local", "ray"), help="in-process, or Ray Data")
    p.add_argument("--address", help="--engine ray: an existing cluster (default: a local Ray)")
    p.add_argument("--actors", type=int, default=2, help="--engine ray: model actors (one per GPU on a GPU node)")
    p.add_argument("--no-progress", action="store_true", help="no bar on a terminal (progress lines in logs stay)")
    args = p.parse_args(argv)
    for name in ("part_size", "batch_size", "threads", "top_k", "actors"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.select < 0:
        p.error("--select must be >= 0")
    if not 0 < args.shift_alpha < 1:
        p.error("--shift-alpha must be in (0, 1)")
    return args


def run_local(args: argparse.Namespace, settings: Settings) -> tuple[Parts, BatchScorer]:
    """Score every input in this process into the parts of ``--out`` (complete parts of an earlier run skipped)."""
    scorer = BatchScorer(args.artifact, settings, options_of(args))
    source = open_source(args.input, args.column, args.id_column, scorer.modality)
    parts = Parts(args.out, args.format, args.part_size, run_record(args, scorer.describe()))
    done, total = parts.done(), source.count()
    start = min(done * args.part_size, total)
    progress = bar(desc="batch", total=total, initial=start)
    k, buf = done, []
    for rows in scorer.rows(source.chunks(args.batch_size, skip=start), threads=args.threads):
        buf += rows
        progress.update(len(rows))
        while len(buf) >= args.part_size:
            parts.write(k, buf[: args.part_size])
            k, buf = k + 1, buf[args.part_size :]
    if buf:
        parts.write(k, buf)
    progress.close()
    return parts, scorer


def finish(args: argparse.Namespace, parts: Parts, scorer_guarantees: Any, metric: str, policy: str) -> dict:
    """The summary of a run's parts: label-free accuracy, the shift test (and the suspension it brings), the K inputs
    to label first. Written to ``summary.json``; idempotent (a restarted run finishes alike)."""
    rows = list(parts.all_rows(SUMMARY_COLUMNS))
    summary: dict[str, Any] = {"rows": len(rows), "errors": sum(r["error"] is not None for r in rows)}
    summary |= label_free(rows)
    test = None
    if scorer_guarantees is not None:
        scores = [r["ood_score"] for r in rows if r["error"] is None]
        test = batch_shift_test(scores, scorer_guarantees.ood_scores, metric, args.shift_alpha)
        test["policy"] = policy
        summary["shift_test"] = test
    suspended = test is not None and test["rejected"] and policy != "off"
    if suspended:  # part by part, only rows not yet suspended: a run killed here and started again ends alike
        for k in range(parts.done()):
            rows = parts.read(k)
            if any(r["error"] is None and not r["suspended"] for r in rows):
                parts.write(k, [r if r["suspended"] else suspend(r, policy, test) for r in rows])
    summary["suspended"] = suspended
    if args.select:
        chosen = select(enumerate(parts.all_rows(SELECT_COLUMNS)), args.select, args.by)
        path = write_selection(args, parts.out, chosen)
        summary["selected"] = {"k": len(chosen), "by": args.by, "file": path.name}
    (parts.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def write_selection(args: argparse.Namespace, out: Path, chosen: list[tuple[int, dict]]) -> Path:
    """``to_label.csv``: the chosen inputs best first (position, id, the input where it is a text, the model's label,
    the score it was chosen by) with an empty ``label`` column to fill (docs/batch.md, "Labels back")."""
    path = out / "to_label.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["position", "id", "predicted", args.by, "label"])
        for i, r in chosen:
            w.writerow([i, r["id"], r["label"], r[args.by] if args.by != "ood" else r["ood_p_value"], ""])
    return path


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(message)s")
    if args.no_progress:
        set_enabled(False)
    try:
        settings = Settings()
    except ValidationError as e:
        print(f"invalid HYDRA_* settings: {'; '.join(settings_errors(e))}", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        if not args.input.exists():
            raise BatchInputError(f"{args.input}: no such file or folder")
        if args.engine == "ray":
            parts, guarantees, metric = run_ray(args, settings)
        else:
            parts, scorer = run_local(args, settings)
            guarantees, metric = scorer.rt.guarantees, scorer.rt.ood_metric
        summary = finish(args, parts, guarantees, metric, settings.drift_policy)
    except (ServiceError, OSError) as e:
        print(f"hydra-predict: {e}", file=sys.stderr)
        return 2
    summary["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(summary, indent=1))
    return 0
