"""Feedback: true labels matched to the predictions they label, one status per item.

An item ``{id, index, label}`` labels the ``index``-th prediction of the answer ``id`` served by the model the
feedback is sent to. Its status, in this order of checks:

* ``unknown_id``: no such prediction is stored (a wrong id or index, one deleted by retention, an id longer than an
  ``X-Request-ID`` can be, or a negative index);
* ``invalid_label``: the label is neither a label name (a non-empty string of at most ``max_label_chars``
  characters with a visible character) nor a label index within the prediction's labels;
* ``duplicate``: the prediction is labelled already (by an earlier request, any replica's, or an earlier item of
  this batch); the first label stays, whatever this one says, so sending a batch twice changes nothing;
* ``accepted``: stored. A label name outside the prediction's labels (the model's, or a zero-shot answer's
  candidate labels) marks the input as foreign: it is stored with no label index.

Names match exactly (case and spaces count). The whole batch is one transaction, and the feedback transactions of
one model run one at a time (SQLite's write lock; a PostgreSQL advisory lock), so that no two replicas both find a
prediction unlabelled and both label it. When the answer comes back, every accepted item is committed (on disk for
SQLite, ``synchronous=FULL``); when the database fails, nothing is, and :class:`~.errors.StoreUnavailable` says so
(a retry is safe). Lookups go by chunks of :data:`CHUNK_IDS` ids, so a batch of 10,000 items costs a few dozen
statements. A prediction still waiting in the writer's queue is written first, in the same transaction, so that a
label sent right after its answer finds it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sqlalchemy import Connection, insert, select

from service.store.database import Database
from service.store.records import FeedbackItem, FeedbackStatus, PredictionRecord
from service.store.schema import ID_CHARS, feedback, predictions
from service.store.writes import prediction_row

__all__ = ["CHUNK_IDS", "add_feedback"]

CHUNK_IDS = 500  # ids per lookup statement
ANALYZE_ROWS = 1_000  # PostgreSQL: refresh the planner's statistics after a batch this large (Database.analyze)
Key = tuple[str, int]


def _valid_key(item: FeedbackItem) -> bool:
    ok_id = isinstance(item.id, str) and 0 < len(item.id) <= ID_CHARS
    return ok_id and isinstance(item.index, int) and not isinstance(item.index, bool) and item.index >= 0


def _valid_label_shape(label: object, max_chars: int) -> bool:
    if isinstance(label, bool):
        return False
    if isinstance(label, int):
        return label >= 0
    return isinstance(label, str) and 0 < len(label) <= max_chars and bool(label.strip())


def _chunks(values: Sequence[str], size: int) -> Iterable[Sequence[str]]:
    for start in range(0, len(values), size):
        yield values[start : start + size]


def _stored(conn: Connection, model: str, ids: Sequence[str]) -> tuple[dict[Key, Any], set[Key]]:
    """The predictions among ``ids`` (key -> (version, zero-shot labels or None)) and the keys labelled already."""
    p, f = predictions, feedback
    found: dict[Key, Any] = {}
    labelled: set[Key] = set()
    for chunk in _chunks(ids, CHUNK_IDS):
        rows = conn.execute(
            select(p.c.id, p.c.idx, p.c.version, p.c.labels).where(p.c.model == model, p.c.id.in_(chunk))
        )
        found.update(((r.id, r.idx), (r.version, r.labels)) for r in rows)
        labelled.update(
            (r.id, r.idx) for r in conn.execute(select(f.c.id, f.c.idx).where(f.c.model == model, f.c.id.in_(chunk)))
        )
    return found, labelled


class _Labels:
    """Label name -> index for the model's labels and each zero-shot answer's own, built once per label list."""

    def __init__(self, model_labels: Sequence[str]) -> None:
        self._model = tuple(model_labels)
        self._index: dict[tuple[str, ...], dict[str, int]] = {}

    def resolve(self, label: str | int, own: Sequence[str] | None) -> tuple[bool, int | None, str]:
        """(valid, label index or None for a foreign name, the name to store) of a well-formed label."""
        names = self._model if own is None else tuple(own)
        if isinstance(label, int):
            return (True, label, names[label]) if label < len(names) else (False, None, "")
        index = self._index.get(names)
        if index is None:
            index = self._index[names] = {name: i for i, name in enumerate(names)}
        return True, index.get(label), label


def _decide(
    items: Sequence[FeedbackItem],
    statuses: list[FeedbackStatus | None],
    found: dict[Key, Any],
    labelled: set[Key],
    labels: _Labels,
) -> dict[Key, tuple[int, str, int | None]]:
    """Fill in the statuses decided before writing; key -> (item position, label, label index) of the new rows."""
    new: dict[Key, tuple[int, str, int | None]] = {}
    for i, item in enumerate(items):
        if statuses[i] is not None:
            continue
        key = (item.id, item.index)
        if key not in found:
            statuses[i] = "unknown_id"
            continue
        valid, label_index, name = labels.resolve(item.label, found[key][1])
        if not valid:
            statuses[i] = "invalid_label"
        elif key in labelled or key in new:
            statuses[i] = "duplicate"
        else:
            new[key] = (i, name, label_index)
    return new


def add_feedback(
    db: Database,
    model: str,
    labels: Sequence[str],
    items: Sequence[FeedbackItem],
    *,
    now: float,
    max_label_chars: int = 10_000,
    pending: Callable[[set[str]], Sequence[PredictionRecord]] = lambda ids: (),
) -> list[FeedbackStatus]:
    """Match ``items`` to ``model``'s stored predictions and store their labels (``labels``: the model's own); one
    status per item, in order (module docstring). ``pending(ids)``: the records of these answer ids not yet written
    (the writer's queue); they are written first, in the same transaction. Raises
    :class:`~.errors.StoreUnavailable` when nothing could be committed because the database is down or busy."""
    statuses: list[FeedbackStatus | None] = [None] * len(items)
    for i, item in enumerate(items):
        if not _valid_key(item):
            statuses[i] = "unknown_id"
    ids = sorted({item.id for i, item in enumerate(items) if statuses[i] is None})
    with db.guarded("feedback"), db.write() as conn:
        db.serialize(conn, f"feedback/{model}")  # the checks below and the insert are one atomic step
        queued = pending(set(ids))
        if queued:
            conn.execute(db.insert(predictions), [prediction_row(r) for r in queued])
        found, labelled = _stored(conn, model, ids)
        for i, item in enumerate(items):
            if statuses[i] is None and (item.id, item.index) in found:
                if not _valid_label_shape(item.label, max_label_chars):
                    statuses[i] = "invalid_label"
        new = _decide(items, statuses, found, labelled, _Labels(labels))
        if new:
            rows = [
                dict(model=model, id=k[0], idx=k[1], version=found[k][0], label=name, label_index=li, ts=now)
                for k, (_, name, li) in new.items()
            ]
            conn.execute(insert(feedback), rows)
    if len(new) >= ANALYZE_ROWS:
        db.analyze("feedback")
    for i, _, _ in new.values():
        statuses[i] = "accepted"
    return [s if s is not None else "unknown_id" for s in statuses]
