"""The store's tables, in SQLAlchemy Core: one definition for SQLite and PostgreSQL.

``predictions``: one row per served prediction (an input of an answer), keyed by ``(model, id, idx)``: the model
name, the answer's ``id`` (its ``X-Request-ID``) and the prediction's position in the answer. It holds what the live
statistics need (the top label and its probability, the served OOD score, p-value and flag, the conformal set and
its level, the accept decision and its risk target, optionally the probabilities) and never the input itself. A
zero-shot answer's candidate labels are kept (``labels``): its label indices refer to them. ``seq`` orders the rows
as they were written, so retention by rows deletes the oldest.

``feedback``: one true label per prediction, unique on the same key, so that a second label for it is a duplicate
whichever replica receives it. ``label_index`` is the label's index in the prediction's labels, or NULL when the
label is not one of them (the input was foreign to the model).

``state``: shared online state (an adaptive conformal level, an alarm) as a JSON value per key, with a version for
compare-and-set, so that replicas agree.

Times are Unix seconds (double precision), UTC by construction, the same on both backends.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Double,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
)

__all__ = ["ID_CHARS", "SCHEMA_KEY", "SCHEMA_VERSION", "feedback", "metadata", "predictions", "state"]

SCHEMA_VERSION = 1  # bumped with any change of the tables below; a store written by another version is refused
SCHEMA_KEY = "hydra.store.schema"  # the state row that records it
ID_CHARS = 128  # an answer's id is an X-Request-ID: 1-128 characters (service/tracing.py)
NAME_CHARS = 256

metadata = MetaData()

# SQLite autoincrements only an INTEGER PRIMARY KEY (the rowid); PostgreSQL gets a 64-bit identity
_SEQ = BigInteger().with_variant(Integer(), "sqlite")

predictions = Table(
    "predictions",
    metadata,
    Column("seq", _SEQ, primary_key=True, autoincrement=True),
    Column("model", String(NAME_CHARS), nullable=False),
    Column("id", String(ID_CHARS), nullable=False),
    Column("idx", Integer, nullable=False),  # the prediction's position in its answer
    Column("version", String(NAME_CHARS), nullable=False),
    Column("ts", Double, nullable=False),  # when it was answered
    Column("label", Integer, nullable=False),  # the top label's index
    Column("confidence", Double, nullable=False),  # the top label's probability
    Column("ood_score", Double, nullable=False),
    Column("ood_flag", Boolean, nullable=False),
    Column("ood_p", Double),  # conformal p-value of the OOD score (models with a calibration split)
    Column("pset", JSON(none_as_null=True)),  # the conformal set: label indices, ascending
    Column("set_alpha", Double),
    Column("adaptive", Boolean, nullable=False, default=False),  # the set came from the online (adaptive) method
    Column("accept", Boolean),  # the selective rule's decision
    Column("risk", Double),  # its risk target
    Column("labels", JSON(none_as_null=True)),  # a zero-shot answer's candidate labels (NULL: the model's own)
    Column("probs", LargeBinary),  # (C,) float32 little-endian, when stored (HYDRA_STORE_PROBS)
    UniqueConstraint("model", "id", "idx", name="uq_predictions_key"),
)
Index("ix_predictions_model_ts", predictions.c.model, predictions.c.version, predictions.c.ts)
Index("ix_predictions_ts", predictions.c.ts)

feedback = Table(
    "feedback",
    metadata,
    Column("model", String(NAME_CHARS), primary_key=True),
    Column("id", String(ID_CHARS), primary_key=True),
    Column("idx", Integer, primary_key=True),
    Column("version", String(NAME_CHARS), nullable=False),  # the labelled prediction's (counts need no join)
    Column("label", Text, nullable=False),  # as sent
    Column("label_index", Integer),  # NULL: a label outside the prediction's labels (a foreign input)
    Column("ts", Double, nullable=False),  # when it was received
)
Index("ix_feedback_model_ts", feedback.c.model, feedback.c.version, feedback.c.ts)

state = Table(
    "state",
    metadata,
    Column("key", String(NAME_CHARS), primary_key=True),
    Column("value", JSON, nullable=False),
    Column("version", BigInteger, nullable=False),  # 1 when created, +1 on every write
    Column("updated", Double, nullable=False),
)
