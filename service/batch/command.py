"""``hydra-predict`` (``python -m service.batch``): score a folder, CSV, JSONL or Parquet file with an artifact, every
row with the fields of ``/predict``, in-process by default or on Ray Data (``--engine ray``); ``hydra-predict
feedback FILE`` sends the labels of a ``--select`` file back to the prediction store; docs/batch.md.

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

import numpy as np
from pydantic import ValidationError

from service.batch.batch_summary import SELECT_BY, batch_shift_test, label_free, select, suspend
from service.batch.inputs import BatchInputError, open_source
from service.batch.part_files import FORMATS, Parts
from service.batch.ray_engine import run_ray
from service.batch.run_spec import options_of, run_record
from service.batch.scorer import BatchScorer
from service.core.artifact import Manifest, load_manifest
from service.core.errors import ServiceError
from service.core.progress import bar, set_enabled
from service.settings import Settings, settings_errors
from service.store import PredictionStore, open_store
from service.store.records import FEEDBACK_STATUSES, FeedbackItem

__all__ = ["feedback", "finish", "main", "parse_args", "run_local"]

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
    p.add_argument(
        "--record",
        action="store_true",
        help="record every answer in the prediction store (HYDRA_STORE*), so that labels can come back for them",
    )
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
    store = open_recording(args, settings)
    if store is not None:
        scorer.record_into(store, parts.run_id)
    done, total = parts.done(), source.count()
    start = min(done * args.part_size, total)
    progress = bar(desc="batch", total=total, initial=start)
    k, buf, t0 = done, [], time.monotonic()
    for rows in scorer.rows(source.chunks(args.batch_size, skip=start), threads=args.threads, first=start):
        buf += rows
        progress.update(len(rows))
        while len(buf) >= args.part_size:
            parts.write(k, buf[: args.part_size])
            k, buf = k + 1, buf[args.part_size :]
    if buf:
        parts.write(k, buf)
    progress.close()
    parts.rate = (total - start, time.monotonic() - t0)
    if store is not None:
        store.close()  # every answer written before the run ends
    return parts, scorer


def open_recording(args: argparse.Namespace, settings: Settings) -> PredictionStore | None:
    """The prediction store the answers are recorded in (``--record``); a one-line error when it is off."""
    if not args.record:
        return None
    store = open_store(settings)
    if store is None:
        raise BatchInputError("--record needs the prediction store: HYDRA_STORE is off")
    return store


def finish(args: argparse.Namespace, parts: Parts, manifest: Manifest, guarantees: Any, policy: str) -> dict:
    """The summary of a run's parts: label-free accuracy, the shift test (and the suspension it brings), the K inputs
    to label first. Written to ``summary.json``; idempotent (a restarted run finishes alike)."""
    scores, errors = ood_scores(parts)
    summary: dict[str, Any] = {"rows": len(scores) + errors, "errors": errors}
    scored, seconds = parts.rate
    summary["scored_now"] = {"inputs": scored, "seconds": round(seconds, 3), "inputs_per_s": _rate(scored, seconds)}
    metric = manifest.uncertainty.ood_score
    summary |= label_free(parts.all_rows(SUMMARY_COLUMNS), calibration=calibration_of(guarantees, manifest))
    test = None
    if guarantees is not None:
        test = batch_shift_test(scores, guarantees.ood_scores, metric, args.shift_alpha)
        test["policy"] = policy
        summary["shift_test"] = test
    summary["suspended"] = test is not None and test["rejected"] and policy != "off"
    if test is not None and summary["suspended"]:
        suspend_parts(parts, policy, test)
    if args.select:
        chosen = select(enumerate(parts.all_rows(SELECT_COLUMNS)), args.select, args.by, metric)
        path = write_selection(args, parts, chosen)
        summary["selected"] = {"k": len(chosen), "by": args.by, "file": path.name}
    (parts.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return summary


def ood_scores(parts: Parts) -> tuple[np.ndarray, int]:
    """The answered rows' OOD scores ``(n,)`` and the count of rows with an error, read part by part: the rows are
    never all in memory, only their scores (8 bytes each)."""
    chunks, errors = [], 0
    for k in range(parts.done()):
        rows = parts.read(k, ("error", "ood_score"))
        ok = [r["ood_score"] for r in rows if r["error"] is None]
        chunks.append(np.asarray(ok, dtype=np.float64))
        errors += len(rows) - len(ok)
    return (np.concatenate(chunks) if chunks else np.zeros(0)), errors


def calibration_of(guarantees: Any, manifest: Manifest) -> tuple[float, int, Any] | None:
    """``(accuracy, n, confidences)`` of the artifact's calibration split (None: no split, or no confidences)."""
    if guarantees is None or guarantees.ranks is None or manifest.guarantees is None:
        return None
    errors, n = manifest.guarantees.calibration_errors, guarantees.ranks.n
    if errors is None or not n:
        return None
    return 1 - errors / n, n, guarantees.ranks.confidences


def suspend_parts(parts: Parts, policy: str, test: dict[str, Any]) -> None:
    """Every answered row not yet suspended, suspended (:func:`~service.batch.batch_summary.suspend`), part by
    part: a run killed here and started again ends alike."""
    for k in range(parts.done()):
        rows = parts.read(k)
        if any(r["error"] is None and not r["suspended"] for r in rows):
            parts.write(k, [r if r["suspended"] else suspend(r, policy, test) for r in rows])


def _rate(n: int, seconds: float) -> float | None:
    return round(n / seconds, 2) if n and seconds > 0 else None


def write_selection(args: argparse.Namespace, parts: Parts, chosen: list[tuple[int, dict]]) -> Path:
    """``to_label.csv``: the chosen inputs best first (position, id, the model's label, the score it was chosen by,
    with ``--record`` the answer's id in the store) and an empty ``label`` column to fill (docs/batch.md, "Labels
    back")."""
    path = parts.out / "to_label.csv"
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["position", "id", "predicted", args.by, *(["answer_id"] if args.record else []), "label"])
        for i, r in chosen:
            by = (
                r[args.by]
                if args.by != "ood"
                else (r["ood_p_value"] if r["ood_p_value"] is not None else r["ood_score"])
            )
            w.writerow([i, r["id"], r["label"], by, *([f"{parts.run_id}:{i}"] if args.record else []), ""])
    return path


def feedback(argv: Sequence[str]) -> int:
    """``hydra-predict feedback FILE --artifact DIR``: the labels filled in a ``to_label.csv`` (rows with an
    ``answer_id`` and a ``label``; empty labels skipped) into the prediction store, as ``/feedback`` puts them."""
    p = argparse.ArgumentParser(prog="hydra-predict feedback", description=feedback.__doc__)
    p.add_argument("file", type=Path, help="a to_label.csv of a --record run, its label column filled")
    p.add_argument("--artifact", type=Path, required=True, help="the artifact the run scored with")
    args = p.parse_args(argv)
    try:
        manifest = load_manifest(args.artifact)
        items = labelled_items(args.file)
        store = open_recording(argparse.Namespace(record=True), Settings())
        assert store is not None
        try:
            statuses = store.add_feedback(manifest.name, manifest.labels or [], items)
        finally:
            store.close()
    except (ServiceError, OSError, ValidationError) as e:
        print(f"hydra-predict feedback: {e}", file=sys.stderr)
        return 2
    counts = {s: statuses.count(s) for s in FEEDBACK_STATUSES}
    print(json.dumps({"labels": len(items), **counts}))
    return 0


def labelled_items(path: Path) -> list[FeedbackItem]:
    """The filled rows of a ``to_label.csv`` as feedback items (answer ``id``, index 0, ``label``)."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if rows and "answer_id" not in rows[0]:
        raise BatchInputError(f"{path}: no answer_id column: the run was not recorded (run it with --record)")
    return [FeedbackItem(r["answer_id"], 0, r["label"].strip()) for r in rows if r.get("label", "").strip()]


class _Stderr(logging.StreamHandler):
    """A handler that writes to ``sys.stderr`` as it is when a record comes (a caller may replace it: a test's
    capture, a notebook), not as it was when the handler was made."""

    @property
    def stream(self) -> Any:
        return sys.stderr

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["feedback"]:
        return feedback(argv[1:])
    args = parse_args(argv)
    # INFO lines (the model's backend, the progress) on stderr while the command runs; the caller's logging after
    root, handler, level = logging.getLogger(), _Stderr(), logging.getLogger().level
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    if args.no_progress:
        set_enabled(False)
    try:
        return run(args)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        set_enabled(None)


def run(args: argparse.Namespace) -> int:
    """The command's run (:func:`main` sets up its logging): the rows, then the summary, printed."""
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
            parts, manifest, guarantees = run_ray(args, settings)
        else:
            parts, scorer = run_local(args, settings)
            manifest, guarantees = scorer.rt.manifest, scorer.rt.guarantees
        summary = finish(args, parts, manifest, guarantees, settings.drift_policy)
    except (ServiceError, OSError) as e:
        print(f"hydra-predict: {e}", file=sys.stderr)
        return 2
    summary["seconds"] = round(time.monotonic() - t0, 1)
    print(json.dumps(summary, indent=1))
    return 0
