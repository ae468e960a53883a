"""The writer's statements: prediction rows in, and retention (old rows out, with their feedback).

Retention deletes, oldest first, the predictions older than the age limit and those beyond the row limit (over all
models), and the feedback of each deleted prediction with it. It works in chunks of :data:`CHUNK_ROWS` rows, one
transaction each, so that it never holds SQLite's one write lock for long: feedback waits for that lock.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from sqlalchemy import Connection, and_, delete, exists, select

from service.store.database import Database
from service.store.records import PredictionRecord
from service.store.schema import feedback, predictions

__all__ = ["CHUNK_ROWS", "Retention", "apply_retention", "insert_predictions", "prediction_row"]

CHUNK_ROWS = 2_000  # rows deleted per retention transaction (and SQL parameters per statement: SQLite takes 32,766)


@dataclass(frozen=True)
class Retention:
    """Keep predictions at most ``max_age_s`` seconds old, and at most ``max_rows`` of them."""

    max_age_s: float
    max_rows: int


def prediction_row(r: PredictionRecord) -> dict[str, Any]:
    """The ``predictions`` row of a record (probabilities as float32 little-endian bytes)."""
    return {
        "model": r.model,
        "id": r.id,
        "idx": r.index,
        "version": r.version,
        "ts": r.time,
        "label": r.label,
        "confidence": r.confidence,
        "ood_score": r.ood_score,
        "ood_flag": r.ood_flag,
        "ood_p": r.ood_p,
        "pset": None if r.set is None else list(r.set),
        "set_alpha": r.set_alpha,
        "adaptive": r.adaptive,
        "accept": r.accept,
        "risk": r.risk,
        "labels": None if r.labels is None else list(r.labels),
        "probs": None if r.probs is None else np.ascontiguousarray(r.probs, dtype="<f4").tobytes(),
    }


def insert_predictions(db: Database, records: Sequence[PredictionRecord]) -> None:
    """Write ``records`` in one transaction; a key already stored (an answer id sent twice) keeps its first row."""
    rows = [prediction_row(r) for r in records]
    with db.write() as conn:
        conn.execute(db.insert(predictions), rows)


def _delete_chunk(conn: Connection, seqs: list[int]) -> int:
    """Delete the predictions ``seqs`` and their feedback."""
    p = predictions
    same_key = and_(p.c.model == feedback.c.model, p.c.id == feedback.c.id, p.c.idx == feedback.c.idx)
    conn.execute(delete(feedback).where(exists().where(p.c.seq.in_(seqs), same_key)))
    return conn.execute(delete(p).where(p.c.seq.in_(seqs))).rowcount or 0


def _delete_where(db: Database, condition: Any) -> int:
    """Delete the predictions matching ``condition`` (and their feedback), oldest first, chunk by chunk."""
    deleted = 0
    while True:
        with db.write() as conn:
            query = select(predictions.c.seq).where(condition).order_by(predictions.c.seq).limit(CHUNK_ROWS)
            seqs = list(conn.execute(query).scalars())
            if not seqs:
                return deleted
            deleted += _delete_chunk(conn, seqs)
        if len(seqs) < CHUNK_ROWS:
            return deleted


def apply_retention(db: Database, retention: Retention, now: float) -> int:
    """Delete what is past ``retention`` at time ``now`` (Unix seconds); the number of predictions deleted."""
    deleted = _delete_where(db, predictions.c.ts < now - retention.max_age_s)
    with db.read() as conn:
        newest_beyond = select(predictions.c.seq).order_by(predictions.c.seq.desc()).offset(retention.max_rows)
        cutoff = conn.execute(newest_beyond.limit(1)).scalar()
    if cutoff is not None:
        deleted += _delete_where(db, predictions.c.seq <= cutoff)
    return deleted
