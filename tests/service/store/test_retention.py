"""Retention on both backends: predictions older than the age limit, and the oldest beyond the row limit, are
deleted with their feedback, in chunks; the writer applies it on its own, so the store stays bounded."""

from __future__ import annotations

import time
from pathlib import Path

from service.store import FeedbackItem
from service.store import writes as writes_module
from service.store.writes import Retention, apply_retention
from tests.service.store.test_store import LABELS, rec

DAY = 86_400.0


def _wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


def test_by_age_with_feedback(make_store, monkeypatch):
    monkeypatch.setattr(writes_module, "CHUNK_ROWS", 7)  # several chunks
    store = make_store()
    now = time.time()
    store.record([rec(f"old{i}", 0, time=now - 40 * DAY) for i in range(20)])
    store.record([rec(f"new{i}", 0, time=now - 1 * DAY) for i in range(5)])
    labelled = [FeedbackItem(f"old{i}", 0, "cat") for i in range(10)] + [FeedbackItem("new0", 0, "dog")]
    assert store.add_feedback("m", LABELS, labelled) == ["accepted"] * 11
    assert store.flush(10.0)  # every record written (feedback wrote only the ones it labels)
    deleted = apply_retention(store._db, Retention(max_age_s=30 * DAY, max_rows=1_000), now)
    assert deleted == 20
    counts = store.counts("m")
    assert (counts.predictions, counts.labelled) == (5, 1)
    assert store.served("m").ids == [f"new{i}" for i in range(5)] and store.labelled("m").ids == ["new0"]
    assert store.add_feedback("m", LABELS, [FeedbackItem("old3", 0, "cat")]) == ["unknown_id"]


def test_by_rows_keeps_the_newest(make_store, monkeypatch):
    monkeypatch.setattr(writes_module, "CHUNK_ROWS", 7)
    store = make_store()
    for i in range(30):  # written in this order: seq follows it
        store.record([rec(f"r{i}", 0)])
        assert store.flush(5.0)
    assert store.add_feedback("m", LABELS, [FeedbackItem(f"r{i}", 0, "cat") for i in (0, 5, 29)]) == ["accepted"] * 3
    deleted = apply_retention(store._db, Retention(max_age_s=30 * DAY, max_rows=12), time.time())
    assert deleted == 18
    assert store.served("m").ids == [f"r{i}" for i in range(18, 30)]
    assert store.labelled("m").ids == ["r29"] and store.counts("m").labelled == 1
    assert apply_retention(store._db, Retention(max_age_s=30 * DAY, max_rows=12), time.time()) == 0


def test_the_writer_applies_it_periodically(make_store):
    """Rows beyond the limit (here 100) disappear on their own, oldest first, while records keep coming."""
    store = make_store(max_rows=100, retention_interval_s=0.05, flush_rows=50)
    for batch in range(5):
        store.record([rec(f"w{batch}-{i}", 0) for i in range(50)])
        assert store.flush(5.0)
    # the writer commits the deletion, then counts it: wait for both (read between them, the count lags)
    assert _wait_for(lambda: store.counts("m").predictions == 100 and store.stats().retention_deleted == 150)
    assert store.stats().retention_deleted == 150
    assert store.served("m").ids == [f"w{b}-{i}" for b in (3, 4) for i in range(50)]


def test_the_writer_applies_the_age_limit(make_store):
    store = make_store(retention_days=1.0, retention_interval_s=0.05)
    now = time.time()
    store.record([rec("young", 0, time=now - 0.5 * DAY), rec("old", 0, time=now - 2 * DAY)])
    assert store.flush(5.0)
    assert _wait_for(lambda: store.stats().retention_deleted == 1)
    assert store.served("m").ids == ["young"]


def test_each_retention_pass_empties_sqlites_write_ahead_log(make_store):
    """SQLite restarts its log only when no reader is inside it; after each retention pass the writer checkpoints
    and truncates it, so the files stay bounded under steady traffic (PostgreSQL: nothing to do)."""
    store = make_store(max_rows=1_000, retention_interval_s=0.2, flush_rows=500)
    db = store._db
    if db.dialect != "sqlite":
        return  # the PostgreSQL run checks only that the call is harmless: the writer kept working above
    wal = Path(str(db.engine.url.database) + "-wal")
    with db.read() as conn:  # a reader inside the log while it fills: SQLite's own checkpoints cannot restart it
        conn.exec_driver_sql("SELECT count(*) FROM predictions").all()
        for batch in range(6):
            store.record([rec(f"c{batch}-{i}", 0) for i in range(500)])
            assert store.flush(5.0)
        assert wal.stat().st_size > 100_000
    assert _wait_for(lambda: store.stats().retention_deleted >= 2_000)  # a pass after the reader left
    assert _wait_for(lambda: wal.stat().st_size == 0)
