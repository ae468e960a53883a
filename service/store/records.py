"""What goes into the store and what comes out of it: plain typed records, no database in sight.

In: :class:`PredictionRecord` (one served prediction; :func:`records_from_items` makes them from a runtime's
results), :class:`FeedbackItem` (one true label). Out: :data:`FeedbackStatus` per item, :class:`Rows` (served
predictions with their labels where given, as arrays for the statistics), :class:`Counts`, :class:`StateEntry`,
and :class:`StoreStats` (the writer's counters, for the metrics).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

__all__ = [
    "FEEDBACK_STATUSES",
    "FOREIGN",
    "UNLABELLED",
    "Counts",
    "FeedbackItem",
    "FeedbackStatus",
    "PredictionRecord",
    "Rows",
    "ServedItem",
    "StateEntry",
    "StoreStats",
    "records_from_items",
]

FeedbackStatus = Literal["accepted", "duplicate", "unknown_id", "invalid_label"]
FEEDBACK_STATUSES: tuple[FeedbackStatus, ...] = ("accepted", "duplicate", "unknown_id", "invalid_label")
FOREIGN = -1  # Rows.label of a prediction whose true label is outside its labels (a foreign input)
UNLABELLED = -2  # Rows.label of a prediction without feedback


@dataclass(frozen=True)
class PredictionRecord:
    """One served prediction: the ``index``-th input of the answer ``id`` (its ``X-Request-ID``). Never the input."""

    id: str
    index: int
    model: str
    version: str
    time: float  # Unix seconds, when it was answered
    label: int  # the top label's index
    confidence: float  # the top label's probability
    ood_score: float
    ood_flag: bool
    ood_p: float | None = None  # the conformal p-value of the OOD score
    set: tuple[int, ...] | None = None  # the conformal set's label indices, ascending
    set_alpha: float | None = None
    adaptive: bool = False  # the set came from the online (adaptive) method
    accept: bool | None = None  # the selective rule's decision
    risk: float | None = None  # its risk target
    labels: tuple[str, ...] | None = None  # a zero-shot answer's candidate labels (None: the model's own)
    probs: np.ndarray | None = None  # (C,) probabilities, when stored


@dataclass(frozen=True)
class FeedbackItem:
    """A true label for the ``index``-th prediction of the answer ``id``: a label name, or a label index."""

    id: str
    index: int
    label: str | int


class ServedItem(Protocol):
    """What :func:`records_from_items` reads of a runtime's per-input result (``service.runtime.ItemResult``)."""

    probs: np.ndarray
    prediction: int
    ood_score: float
    ood_flag: bool
    p_value: float | None
    prediction_set: np.ndarray | None
    set_alpha: float | None
    accept: bool | None
    risk: float | None


def records_from_items(
    answer_id: str,
    model: str,
    version: str,
    items: Sequence[ServedItem],
    *,
    labels: Sequence[str] | None = None,
    adaptive: bool = False,
    probs: bool = True,
    now: float | None = None,
) -> list[PredictionRecord]:
    """One record per served input of the answer ``answer_id``, in order (``index`` = position in the answer).

    ``labels``: a zero-shot request's candidate labels (None for a model's own labels); ``adaptive``: the sets came
    from the online method; ``probs``: keep each input's probabilities (``HYDRA_STORE_PROBS``).
    """
    t = time.time() if now is None else now
    kept_labels = tuple(labels) if labels is not None else None
    out = []
    for i, item in enumerate(items):
        pset = item.prediction_set
        out.append(
            PredictionRecord(
                id=answer_id,
                index=i,
                model=model,
                version=version,
                time=t,
                label=int(item.prediction),
                confidence=float(item.probs[item.prediction]),
                ood_score=float(item.ood_score),
                ood_flag=bool(item.ood_flag),
                ood_p=None if item.p_value is None else float(item.p_value),
                set=None if pset is None else tuple(int(j) for j in np.flatnonzero(pset)),
                set_alpha=None if item.set_alpha is None else float(item.set_alpha),
                adaptive=adaptive,
                accept=None if item.accept is None else bool(item.accept),
                risk=None if item.risk is None else float(item.risk),
                labels=kept_labels,
                probs=np.asarray(item.probs, dtype=np.float32) if probs else None,
            )
        )
    return out


@dataclass
class Rows:
    """Served predictions of one model, oldest first, with their true labels where feedback came: one array entry
    per prediction, ``n`` in all.

    ``label`` is the true label's index, :data:`FOREIGN` (-1) for a label outside the prediction's labels, or
    :data:`UNLABELLED` (-2) without feedback. Optional fields are NaN (floats) or False (``has_*`` masks) where the
    prediction had none. ``covered``: the true label is in the served set (False for foreign and unlabelled ones).
    """

    ids: list[str]
    index: np.ndarray  # (n,) int: position in the answer
    version: list[str]
    time: np.ndarray  # (n,) float: when answered
    label_time: np.ndarray  # (n,) float: when labelled; NaN without feedback
    predicted: np.ndarray  # (n,) int: the top label
    confidence: np.ndarray  # (n,) float: its probability
    label: np.ndarray  # (n,) int: the true label, FOREIGN or UNLABELLED
    ood_score: np.ndarray  # (n,) float
    ood_flag: np.ndarray  # (n,) bool
    ood_p: np.ndarray  # (n,) float, NaN where none
    has_set: np.ndarray  # (n,) bool
    covered: np.ndarray  # (n,) bool: label in the set
    set_size: np.ndarray  # (n,) int, 0 where none
    set_alpha: np.ndarray  # (n,) float, NaN where none
    adaptive: np.ndarray  # (n,) bool
    has_accept: np.ndarray  # (n,) bool
    accept: np.ndarray  # (n,) bool, False where none
    risk: np.ndarray  # (n,) float, NaN where none
    probs: np.ndarray | None = None  # (n, C) when every row stored probabilities over the same C labels

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def labelled(self) -> np.ndarray:
        """(n,) bool: feedback came for this prediction."""
        return self.label != UNLABELLED

    @property
    def foreign(self) -> np.ndarray:
        """(n,) bool: its true label is outside its labels."""
        return self.label == FOREIGN

    @property
    def correct(self) -> np.ndarray:
        """(n,) bool: the top label is the true label (False for foreign and unlabelled ones)."""
        return self.label == self.predicted


@dataclass(frozen=True)
class Counts:
    """How much the store holds for a model (and version): predictions, those labelled, and of those foreign."""

    predictions: int
    labelled: int
    foreign: int


@dataclass(frozen=True)
class StateEntry:
    """A shared state value with its version (1 when created, +1 per write) and last write time (Unix seconds)."""

    key: str
    value: object
    version: int
    updated: float


@dataclass
class StoreStats:
    """The writer's counters since start-up, for the metrics. ``dropped`` by reason: ``full`` (the queue was full),
    ``error`` (the database refused the rows, or was down when the store closed), ``closed`` (recorded after
    close). ``queued``: records waiting now. ``up``: the last database operation succeeded."""

    submitted: int = 0
    written: int = 0
    dropped: dict[str, int] = field(default_factory=lambda: {"full": 0, "error": 0, "closed": 0})
    queued: int = 0
    up: bool = False
    last_error: str | None = None
    retention_deleted: int = 0
