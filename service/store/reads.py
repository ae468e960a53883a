"""What the live statistics read: served predictions joined with their feedback, as arrays, and counts.

Two selections of one model's (and optionally one version's) predictions, each returned oldest first:

* ``labelled``: those with feedback, by the time the label arrived; ``last`` keeps the latest ``last`` labels,
  ``since`` those labelled at or after a time. Realised accuracy, coverage, accepted error and the OOD flag's
  precision and recall are computed over these.
* ``served``: all of them, labelled or not, by the time they were answered; ``last`` keeps the latest ``last``
  predictions, ``since`` those answered at or after a time. The label-free accuracy estimate is computed over
  these (and compared with the realised accuracy of the labelled ones among them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from sqlalchemy import Select, and_, func, select

from service.store.database import Database
from service.store.records import FOREIGN, UNLABELLED, Counts, Rows
from service.store.schema import feedback, predictions

__all__ = ["confidence_sums", "count_rows", "read_rows"]

_P, _F = predictions, feedback
_KEY = and_(_F.c.model == _P.c.model, _F.c.id == _P.c.id, _F.c.idx == _P.c.idx)
_JOIN = _P.outerjoin(_F, _KEY)  # every served prediction, with its label when it has one
_LABELLED = _F.join(_P, _KEY)  # the labelled ones only
_COLUMNS = (
    _P.c.id,
    _P.c.idx,
    _P.c.version,
    _P.c.ts,
    _P.c.label,
    _P.c.confidence,
    _P.c.ood_score,
    _P.c.ood_flag,
    _P.c.ood_p,
    _P.c.pset,
    _P.c.set_alpha,
    _P.c.adaptive,
    _P.c.accept,
    _P.c.risk,
    _P.c.probs,
    _F.c.label_index.label("true_index"),
    _F.c.ts.label("label_ts"),
    _F.c.model.label("labelled"),  # NULL when no feedback row joined
)


def _select(model: str, version: str | None, *, labelled: bool, since: float | None, last: int | None) -> Select:
    """The labelled rows are read from the feedback side (an inner join, filtered and ordered on the feedback's
    ``(model, version, ts)`` index), so that reading the labels since a cursor costs the labels read, not every
    prediction stored; the served rows from the predictions' ``(model, version, ts)`` index."""
    src, t = (_LABELLED, _F) if labelled else (_JOIN, _P)  # by label time, or by answer time
    query = select(*_COLUMNS).select_from(src).where(t.c.model == model)
    if version is not None:
        query = query.where(t.c.version == version)
    if since is not None:
        query = query.where(t.c.ts >= since)
    query = query.order_by(t.c.ts.desc(), _P.c.seq.desc())
    return query.limit(last) if last is not None else query


def _floats(values: Sequence[Any]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=np.float64)


def _probs(blobs: Sequence[bytes | None]) -> np.ndarray | None:
    """(n, C) float32 when every row stored probabilities over the same number of labels, else None."""
    if not blobs or any(b is None for b in blobs) or len({len(b) for b in blobs if b is not None}) != 1:
        return None
    return np.frombuffer(b"".join(b for b in blobs if b is not None), dtype="<f4").reshape(len(blobs), -1)  # (n, C)


def _rows(raw: Sequence[Any]) -> Rows:
    """The selected rows (newest first, as selected) -> :class:`Rows`, oldest first."""
    raw = list(reversed(raw))
    truth = [UNLABELLED if r.labelled is None else FOREIGN if r.true_index is None else r.true_index for r in raw]
    label = np.array(truth, dtype=np.int64)
    sets = [r.pset for r in raw]
    return Rows(
        ids=[r.id for r in raw],
        index=np.array([r.idx for r in raw], dtype=np.int64),
        version=[r.version for r in raw],
        time=_floats([r.ts for r in raw]),
        label_time=_floats([r.label_ts for r in raw]),
        predicted=np.array([r.label for r in raw], dtype=np.int64),
        confidence=_floats([r.confidence for r in raw]),
        label=label,
        ood_score=_floats([r.ood_score for r in raw]),
        ood_flag=np.array([bool(r.ood_flag) for r in raw], dtype=bool),
        ood_p=_floats([r.ood_p for r in raw]),
        has_set=np.array([s is not None for s in sets], dtype=bool),
        covered=np.array(
            [s is not None and int(y) >= 0 and int(y) in s for s, y in zip(sets, label, strict=True)], dtype=bool
        ),
        set_size=np.array([0 if s is None else len(s) for s in sets], dtype=np.int64),
        set_alpha=_floats([r.set_alpha for r in raw]),
        adaptive=np.array([bool(r.adaptive) for r in raw], dtype=bool),
        has_accept=np.array([r.accept is not None for r in raw], dtype=bool),
        accept=np.array([bool(r.accept) for r in raw], dtype=bool),
        risk=_floats([r.risk for r in raw]),
        probs=_probs([r.probs for r in raw]),
    )


def read_rows(
    db: Database,
    model: str,
    version: str | None = None,
    *,
    labelled: bool,
    since: float | None = None,
    last: int | None = None,
) -> Rows:
    """``model``'s predictions (of ``version``, or every version), oldest first: the labelled ones by label time
    (``labelled=True``), or all served ones by answer time; ``since`` and ``last`` bound the window."""
    with db.guarded("reading predictions"), db.read() as conn:
        raw = conn.execute(_select(model, version, labelled=labelled, since=since, last=last)).all()
    return _rows(raw)


def count_rows(db: Database, model: str, version: str | None = None) -> Counts:
    """How many predictions of ``model`` (and ``version``) are stored, how many are labelled, how many foreign."""
    served = select(func.count()).select_from(_P).where(_P.c.model == model)
    labelled = select(func.count(), func.count(_F.c.label_index)).select_from(_F).where(_F.c.model == model)
    if version is not None:
        served, labelled = served.where(_P.c.version == version), labelled.where(_F.c.version == version)
    with db.guarded("counting predictions"), db.read() as conn:
        n = conn.execute(served).scalar_one()
        n_labelled, n_in_labels = conn.execute(labelled).one()
    return Counts(predictions=int(n), labelled=int(n_labelled), foreign=int(n_labelled - n_in_labels))


def confidence_sums(db: Database, model: str, version: str | None = None) -> tuple[int, float, float]:
    """``(n, sum p, sum p (1 - p))`` of the top-label probabilities ``p`` of ``model``'s (and ``version``'s)
    predictions, summed by the database."""
    p = _P.c.confidence
    query = select(func.count(), func.sum(p), func.sum(p * (1.0 - p))).where(_P.c.model == model)
    if version is not None:
        query = query.where(_P.c.version == version)
    with db.guarded("summing confidences"), db.read() as conn:
        n, total, var = conn.execute(query).one()
    return int(n), float(total or 0.0), float(var or 0.0)
