"""The store's contract on both backends (SQLite and a real PostgreSQL server, conftest.py): what is recorded comes
back field for field, feedback gets the right status per item, duplicates are idempotent, reads select the right
windows, and shared state is updated by compare-and-set without losing an update."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from sqlalchemy import create_engine, text

from service.runtime.interface import ItemResult
from service.store import (
    FOREIGN,
    UNLABELLED,
    FeedbackItem,
    PredictionRecord,
    PredictionStore,
    StateConflict,
    StoreConfig,
    records_from_items,
)

LABELS = ["cat", "dog", "bird"]


def rec(answer: str, index: int, **fields: object) -> PredictionRecord:
    """A served prediction: top label ``index % 3`` unless told, at time now unless told."""
    base: dict[str, object] = {
        "id": answer,
        "index": index,
        "model": "m",
        "version": "1.0",
        "time": time.time(),
        "label": index % 3,
        "confidence": 0.8,
        "ood_score": 0.8,
        "ood_flag": False,
    }
    base.update(fields)
    return PredictionRecord(**base)  # type: ignore[arg-type]


def test_records_come_back_field_for_field(make_store):
    store = make_store()
    probs = np.array([0.7, 0.2, 0.1], dtype=np.float32)
    full = rec("a", 0, ood_p=0.31, set=(0, 2), set_alpha=0.1, adaptive=True, accept=True, risk=0.05, probs=probs)
    bare = rec("a", 1)
    assert store.record([full, bare]) == 2
    assert store.flush(5.0)
    rows = store.served("m")
    assert rows.n == 2 and rows.ids == ["a", "a"] and rows.index.tolist() == [0, 1]
    assert rows.version == ["1.0", "1.0"] and rows.predicted.tolist() == [0, 1]
    assert rows.time[0] == pytest.approx(full.time) and rows.confidence.tolist() == [0.8, 0.8]
    assert rows.ood_p[0] == pytest.approx(0.31) and np.isnan(rows.ood_p[1])
    assert rows.has_set.tolist() == [True, False] and rows.set_size.tolist() == [2, 0]
    assert rows.set_alpha[0] == pytest.approx(0.1) and rows.adaptive.tolist() == [True, False]
    assert rows.has_accept.tolist() == [True, False] and rows.accept.tolist() == [True, False]
    assert rows.risk[0] == pytest.approx(0.05) and np.isnan(rows.risk[1])
    assert rows.label.tolist() == [UNLABELLED, UNLABELLED] and not rows.labelled.any()
    assert rows.probs is None  # one row has none
    assert store.labelled("m").n == 0
    store.record([rec("b", 0, model="p", probs=probs), rec("b", 1, model="p", probs=probs[::-1])])
    assert store.flush(5.0)
    np.testing.assert_array_equal(store.served("p").probs, np.stack([probs, probs[::-1]]))  # (2, 3)


def test_records_from_a_runtimes_results(make_store):
    """The runtime's ItemResult has what a record needs; the set is stored as label indices."""
    items = [
        ItemResult(
            probs=np.array([0.1, 0.6, 0.3]),
            member_probs=np.zeros((2, 3)),
            prediction=1,
            msp=0.6,
            entropy=0.9,
            expected_entropy=0.8,
            mutual_information=0.1,
            disagreement=0.2,
            ood_score=0.6,
            ood_flag=True,
            p_value=0.02,
            prediction_set=np.array([False, True, True]),
            set_alpha=0.1,
            accept=False,
            risk=0.05,
        )
    ]
    (record,) = records_from_items("req-1", "m", "2.0", items, now=123.0)
    assert (record.id, record.index, record.label, record.confidence, record.set) == ("req-1", 0, 1, 0.6, (1, 2))
    assert record.ood_flag and record.ood_p == 0.02 and record.accept is False and record.time == 123.0
    store = make_store()
    store.record([record])
    assert store.flush(5.0)
    rows = store.served("m")
    np.testing.assert_allclose(rows.probs, [[0.1, 0.6, 0.3]], rtol=1e-6)
    assert store.add_feedback("m", LABELS, [FeedbackItem("req-1", 0, "bird")]) == ["accepted"]
    labelled = store.labelled("m")
    assert (
        labelled.label.tolist() == [2] and labelled.covered.tolist() == [True] and labelled.correct.tolist() == [False]
    )


def test_feedback_statuses(make_store):
    store = make_store()
    store.record([rec("a", i) for i in range(3)] + [rec("z", 0, labels=("sun", "rain"), label=1)])
    items = [
        FeedbackItem("a", 0, "cat"),  # accepted: top label 0 is right
        FeedbackItem("a", 0, "cat"),  # duplicate: in the same batch
        FeedbackItem("a", 1, "unicorn"),  # accepted, foreign
        FeedbackItem("a", 2, 1),  # accepted: a label index
        FeedbackItem("a", 3, "cat"),  # unknown_id: no such index
        FeedbackItem("b", 0, "cat"),  # unknown_id: no such answer
        FeedbackItem("a" * 129, 0, "cat"),  # unknown_id: longer than an X-Request-ID
        FeedbackItem("a", -1, "cat"),  # unknown_id: negative index
        FeedbackItem("z", 0, ""),  # invalid_label: empty
        FeedbackItem("z", 0, "   "),  # invalid_label: nothing visible
        FeedbackItem("z", 0, 2),  # invalid_label: index beyond the answer's own 2 labels
        FeedbackItem("z", 0, True),  # invalid_label: not a label
        FeedbackItem("z", 0, "rain"),  # accepted: the zero-shot answer's own label, index 1
    ]
    statuses = store.add_feedback("m", LABELS, items)
    assert statuses == [
        "accepted",
        "duplicate",
        "accepted",
        "accepted",
        "unknown_id",
        "unknown_id",
        "unknown_id",
        "unknown_id",
        "invalid_label",
        "invalid_label",
        "invalid_label",
        "invalid_label",
        "accepted",
    ]
    assert store.add_feedback("other-model", LABELS, [FeedbackItem("a", 0, "cat")]) == ["unknown_id"]
    rows = store.labelled("m")
    by_key = {
        (i, int(x)): (int(y), bool(c))
        for i, x, y, c in zip(rows.ids, rows.index, rows.label, rows.correct, strict=True)
    }
    assert by_key == {("a", 0): (0, True), ("a", 1): (FOREIGN, False), ("a", 2): (1, False), ("z", 0): (1, True)}
    counts = store.counts("m")
    assert (counts.predictions, counts.labelled, counts.foreign) == (4, 4, 1)


def test_a_long_label_is_invalid(make_store):
    store = make_store(max_label_chars=20)
    store.record([rec("a", 0)])
    assert store.add_feedback("m", LABELS, [FeedbackItem("a", 0, "x" * 21)]) == ["invalid_label"]
    assert store.add_feedback("m", LABELS, [FeedbackItem("a", 0, "x" * 20)]) == ["accepted"]


def test_duplicates_are_idempotent(make_store):
    """A batch sent twice: every item a duplicate the second time, and the first labels stay."""
    store = make_store()
    store.record([rec("a", i) for i in range(4)])
    batch = [FeedbackItem("a", i, LABELS[(i + 1) % 3]) for i in range(4)]
    assert store.add_feedback("m", LABELS, batch) == ["accepted"] * 4
    before = store.labelled("m")
    changed = [FeedbackItem("a", i, "cat") for i in range(4)]
    assert store.add_feedback("m", LABELS, batch) == ["duplicate"] * 4
    assert store.add_feedback("m", LABELS, changed) == ["duplicate"] * 4
    after = store.labelled("m")
    assert after.label.tolist() == before.label.tolist() == [1, 2, 0, 1]
    assert store.counts("m").labelled == 4


def test_a_batch_of_10000_items(make_store):
    """10,000 predictions and a 10,000-item feedback batch (accepted, foreign, unknown, bad and repeated items)."""
    store = make_store(queue=20_000, flush_rows=2_000)
    n = 10_000
    assert store.record([rec(f"r{i // 4}", i % 4) for i in range(n)]) == n
    items = []
    for i in range(n):
        answer, index = f"r{i // 4}", i % 4
        kind = i % 10
        if kind == 7:
            items.append(FeedbackItem(f"x{i}", 0, "cat"))  # unknown
        elif kind == 8:
            items.append(FeedbackItem(answer, index, ""))  # invalid
        elif kind == 9:
            items.append(FeedbackItem(answer, index, "ufo"))  # foreign
        else:
            items.append(FeedbackItem(answer, index, LABELS[i % 3]))
    items[1] = items[0]  # a repeat inside the batch
    statuses = store.add_feedback("m", LABELS, items)
    assert len(statuses) == n
    assert statuses[1] == "duplicate"
    assert statuses.count("unknown_id") == n // 10 and statuses.count("invalid_label") == n // 10
    assert statuses.count("accepted") == n - 2 * (n // 10) - 1
    counts = store.counts("m")
    assert (counts.predictions, counts.labelled, counts.foreign) == (n, statuses.count("accepted"), n // 10)
    assert store.add_feedback("m", LABELS, items).count("accepted") == 0


def test_feedback_right_after_the_answer_finds_its_prediction(make_store):
    """The writer batches (here: every 60 s or 10,000 records); feedback waits for what was queued before it."""
    store = make_store(flush_ms=60_000.0, flush_rows=10_000)
    store.record([rec("fresh", 0)])
    assert store.add_feedback("m", LABELS, [FeedbackItem("fresh", 0, "cat")]) == ["accepted"]


def test_reads_select_windows_versions_and_order(make_store):
    store = make_store()
    t0 = 1_000_000.0
    store.record([rec(f"q{i}", 0, time=t0 + i, version="1.0" if i < 6 else "2.0") for i in range(10)])
    for i in (3, 1, 7, 8):  # labels arrive in this order
        assert store.add_feedback("m", LABELS, [FeedbackItem(f"q{i}", 0, "cat")]) == ["accepted"]
        time.sleep(0.002)
    assert store.labelled("m").ids == ["q3", "q1", "q7", "q8"]  # oldest label first
    assert store.labelled("m", last=2).ids == ["q7", "q8"]
    assert store.labelled("m", "1.0").ids == ["q3", "q1"]
    assert store.served("m").ids == [f"q{i}" for i in range(10)]
    assert store.served("m", last=3).ids == ["q7", "q8", "q9"]
    assert store.served("m", since=t0 + 8).ids == ["q8", "q9"]
    served = store.served("m", "2.0")
    assert served.ids == ["q6", "q7", "q8", "q9"] and served.labelled.tolist() == [False, True, True, False]
    since = store.labelled("m").label_time[2]
    assert store.labelled("m", since=since).ids == ["q7", "q8"]
    c1, c2 = store.counts("m", "1.0"), store.counts("m", "2.0")
    assert (c1.predictions, c1.labelled, c2.predictions, c2.labelled) == (6, 2, 4, 2)
    assert store.served("nobody").n == 0 and store.counts("nobody").predictions == 0


def test_an_answer_id_sent_twice_keeps_its_first_record(make_store):
    store = make_store()
    store.record([rec("same", 0, label=1)])
    assert store.flush(5.0)
    store.record([rec("same", 0, label=2), rec("same", 1)])
    assert store.flush(5.0)
    assert store.served("m").predicted.tolist() == [1, 1]
    assert store.stats().dropped == {"full": 0, "error": 0, "closed": 0}


def test_state_compare_and_set(make_store):
    store = make_store()
    assert store.get_state("aci/m") is None
    first = store.put_state("aci/m", {"alpha_t": 0.1}, expected_version=0)
    assert (first.version, first.value) == (1, {"alpha_t": 0.1})
    with pytest.raises(StateConflict):
        store.put_state("aci/m", {"alpha_t": 0.2}, expected_version=0)
    with pytest.raises(StateConflict):
        store.put_state("aci/m", {"alpha_t": 0.2}, expected_version=5)
    assert store.put_state("aci/m", {"alpha_t": 0.12}, expected_version=1).version == 2
    assert store.put_state("aci/m", {"alpha_t": 0.13}).version == 3  # unconditional
    entry = store.get_state("aci/m")
    assert entry is not None and (entry.version, entry.value) == (3, {"alpha_t": 0.13})
    with pytest.raises(ValueError, match="not JSON"):
        store.put_state("aci/m", {"x": float("nan")})


def test_replicas_agree_on_shared_state(make_store):
    """Two stores on one database (two replicas), four threads each adding 1 twenty times: no update is lost."""
    replicas = [make_store(busy_timeout_s=10.0), make_store(busy_timeout_s=10.0)]  # four writers queue for the lock

    def bump(store) -> None:
        for _ in range(20):
            store.update_state("counter", lambda v: {"n": (v or {"n": 0})["n"] + 1}, retries=1000)

    threads = [threading.Thread(target=bump, args=(replicas[i % 2],)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    entry = replicas[1].get_state("counter")
    assert entry is not None and entry.value == {"n": 80} and entry.version == 80


def test_sqlite_runs_in_wal_mode(tmp_path):
    url = f"sqlite:///{tmp_path / 'wal.db'}"
    with PredictionStore(StoreConfig(url=url)) as store:
        store.record([rec("a", 0)])
        assert store.flush(5.0)
    engine = create_engine(url)
    with engine.connect() as conn:
        assert conn.execute(text("PRAGMA journal_mode")).scalar() == "wal"
    engine.dispose()


def test_reading_the_labels_since_a_cursor_searches_the_feedback_index_not_every_prediction():
    """The monitor reads the labels since its cursor after every feedback batch: SQLite's plan for that read starts
    from the feedback's (model, version, ts) index and looks each prediction up by its key, so its cost is the labels
    read, not the predictions stored (a scan of them made a soak with feedback slow down as the store filled)."""
    from sqlalchemy import create_engine
    from sqlalchemy.dialects import sqlite

    from service.store.reads import _select
    from service.store.schema import metadata

    engine = create_engine("sqlite://")
    metadata.create_all(engine)
    query = _select("m", "v", labelled=True, since=1.0, last=None)
    sql = str(query.compile(dialect=sqlite.dialect(), compile_kwargs={"literal_binds": True}))
    with engine.connect() as conn:
        plan = [row[3] for row in conn.exec_driver_sql("EXPLAIN QUERY PLAN " + sql).all()]
    assert plan[0].startswith("SEARCH feedback USING INDEX ix_feedback_model_ts"), plan
    assert any(p.startswith("SEARCH predictions USING INDEX") for p in plan), plan
    assert not any(p.startswith("SCAN") for p in plan), plan
