"""The store when things go wrong, on both backends: a database that is busy or down never blocks or fails
recording (records are queued, and dropped and counted when the queue is full), feedback is refused with
StoreUnavailable rather than half-written, nothing acknowledged is lost when the database or the server process is
killed, and close() writes everything queued.

"Down" is real: the PostgreSQL server is stopped (``pg_ctl stop -m immediate``, a crash), and a SQLite or
PostgreSQL database is locked by another connection (SQLite: ``BEGIN EXCLUSIVE``; PostgreSQL: ``LOCK TABLE ...
ACCESS EXCLUSIVE``), so that every write waits for its lock timeout and fails.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sqlite3
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from sqlalchemy.engine import make_url

from service.store import FeedbackItem, PredictionStore, StoreConfig, StoreError, StoreUnavailable
from service.store.database import resolve_url
from tests.service.store.test_store import LABELS, rec

ROOT = Path(__file__).resolve().parents[3]


@contextlib.contextmanager
def locked(store_url: str) -> Iterator[None]:
    """Another connection holds the database's write lock (SQLite) or the tables' locks (PostgreSQL)."""
    url = make_url(resolve_url(store_url, None))
    if url.get_backend_name() == "sqlite":
        conn = sqlite3.connect(url.database, isolation_level=None)
        conn.execute("BEGIN EXCLUSIVE")
        try:
            yield
        finally:
            conn.execute("ROLLBACK")
            conn.close()
        return
    with psycopg.connect(f"host={url.host} port={url.port} user={url.username} dbname={url.database}") as conn:
        conn.execute("LOCK TABLE predictions, feedback IN ACCESS EXCLUSIVE MODE")
        yield
        conn.rollback()


def _ready(store: PredictionStore) -> None:
    """Create the schema (the writer does at start) so that the lock can name the tables."""
    assert store.flush(5.0)
    store.counts("m")


def test_a_full_queue_drops_and_counts_without_blocking(make_store, store_url):
    """The database hangs (locked, 30 s lock timeout): 200 records are submitted at once, the 50 that fit are
    queued, the 150 others dropped and counted; after the lock is released the 50 are written."""
    store = make_store(queue=50, flush_rows=10, busy_timeout_s=30.0)
    _ready(store)
    with locked(store_url):
        submitted = threading.Thread(
            target=lambda: [store.record([rec(f"f{i}", j) for j in range(10)]) for i in range(20)]
        )
        submitted.start()
        submitted.join(5.0)  # far below the 30 s that a write waits for the lock: record() never waited on it
        assert not submitted.is_alive()
        stats = store.stats()
        assert (stats.submitted, stats.dropped["full"], stats.queued, stats.written) == (200, 150, 50, 0)
    assert store.flush(30.0)
    stats = store.stats()
    assert (stats.written, stats.dropped, stats.queued) == (50, {"full": 150, "error": 0, "closed": 0}, 0)
    assert store.served("m").n == 50 and stats.up


def test_feedback_on_a_locked_database_is_refused_whole(make_store, store_url):
    store = make_store(busy_timeout_s=0.5)
    store.record([rec("a", i) for i in range(3)])
    _ready(store)
    with locked(store_url), pytest.raises(StoreUnavailable) as refused:
        store.add_feedback("m", LABELS, [FeedbackItem("a", i, "cat") for i in range(3)])
    assert refused.value.status == 503 and refused.value.headers["Retry-After"] == "1"
    assert store.counts("m").labelled == 0  # nothing of the refused batch was committed
    assert store.add_feedback("m", LABELS, [FeedbackItem("a", i, "cat") for i in range(3)]) == ["accepted"] * 3


@contextlib.contextmanager
def outage(backend: str, store_url: str, request: pytest.FixtureRequest) -> Iterator[None]:
    """The database goes away: PostgreSQL's server is killed and restarted after; SQLite's file is locked."""
    if backend == "sqlite":
        with locked(store_url):
            yield
        return
    server = request.getfixturevalue("postgres")
    server.stop("immediate")
    try:
        yield
    finally:
        server.start()


def test_a_database_killed_mid_run(make_store, backend, store_url, request):
    """Predictions are recorded and labelled before, during and after an outage of the database: recording never
    fails, feedback during the outage is refused (not acknowledged), and afterwards a new store on the database
    holds every prediction and every acknowledged label."""
    store = make_store(queue=10_000)
    acknowledged: list[tuple[str, int]] = []

    def label(answers: list[str]) -> None:
        items = [FeedbackItem(a, 0, "cat") for a in answers]
        statuses = store.add_feedback("m", LABELS, items)
        acknowledged.extend((i.id, i.index) for i, s in zip(items, statuses, strict=True) if s == "accepted")

    before = [f"b{i}" for i in range(40)]
    assert sum(store.record([rec(a, 0)]) for a in before) == 40
    label(before[:20])
    with outage(backend, store_url, request):
        during = [f"d{i}" for i in range(40)]
        recording = threading.Thread(target=lambda: [store.record([rec(a, 0)]) for a in during])
        recording.start()
        recording.join(5.0)
        assert not recording.is_alive()  # recording neither failed nor waited
        with pytest.raises(StoreUnavailable):
            label(before[20:])
    assert store.flush(30.0)
    label(before[20:] + during)
    stats = store.stats()
    assert stats.dropped == {"full": 0, "error": 0, "closed": 0} and stats.written == 80
    assert len(acknowledged) == 80
    store.close()
    with PredictionStore(StoreConfig(url=store_url)) as after:
        rows = after.labelled("m")
        assert set(zip(rows.ids, rows.index.tolist(), strict=True)) == set(acknowledged)
        assert after.served("m").n == 80


def test_close_writes_everything_queued(make_store, store_url):
    """Records wait in the queue (the writer would write in a minute); close() writes them all."""
    store = make_store(flush_ms=60_000.0, flush_rows=100_000)
    store.record([rec(f"c{i}", 0) for i in range(500)])
    store.close()
    assert store.stats().written == 500
    store.record([rec("late", 0)])  # after close: dropped, counted
    assert store.stats().dropped["closed"] == 1
    with PredictionStore(StoreConfig(url=store_url)) as again:
        assert again.counts("m").predictions == 500


def test_close_gives_up_on_a_dead_database_and_counts_the_loss(make_store, store_url):
    store = make_store(close_timeout_s=1.0, busy_timeout_s=0.5)
    _ready(store)
    with locked(store_url):
        store.record([rec(f"x{i}", 0) for i in range(7)])
        store.close()
    stats = store.stats()
    assert stats.written == 0 and stats.dropped["error"] == 7 and stats.queued == 0


CHILD = """
import sys, time
from service.store import FeedbackItem, PredictionRecord, PredictionStore, StoreConfig
store = PredictionStore(StoreConfig(url=sys.argv[1], flush_ms=5.0))
for i in range(2000):
    store.record([PredictionRecord(f"s{i}", 0, "m", "1.0", time.time(), 0, 0.9, 0.9, False)])
    print("ack", f"s{i}", store.add_feedback("m", ["cat", "dog"], [FeedbackItem(f"s{i}", 0, "cat")])[0], flush=True)
time.sleep(60)
"""


def test_a_killed_server_loses_nothing_acknowledged(store_url):
    """A server process labelling predictions one by one is killed (SIGKILL, no shutdown at all) after 30
    acknowledgements: a new store on the same database holds every label that was acknowledged."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, store_url], cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True
    )
    acknowledged = []
    try:
        assert child.stdout is not None
        for line in child.stdout:
            _, answer, status = line.split()
            assert status == "accepted"
            acknowledged.append(answer)
            if len(acknowledged) == 30:
                break
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    assert len(acknowledged) == 30
    with PredictionStore(StoreConfig(url=store_url)) as after:
        labelled = set(after.labelled("m").ids)
    assert set(acknowledged) <= labelled


def test_a_store_whose_database_is_down_at_start(tmp_path):
    """The server starts with its store's database unreachable: opening, recording and stats work, feedback says
    unavailable."""
    url = "postgresql://hydra@127.0.0.1:9/none"  # nothing listens on port 9 (discard)
    config = StoreConfig(url=url, connect_timeout_s=1.0, flush_ms=10.0)
    with PredictionStore(config) as store:
        assert store.record([rec("a", 0)]) == 1
        with pytest.raises(StoreUnavailable):
            store.add_feedback("m", LABELS, [FeedbackItem("a", 0, "cat")])
        assert not store.stats().up and store.stats().last_error
        store.close(timeout=0.5)
    assert store.stats().dropped["error"] == 1


def test_a_store_of_another_schema_version_is_refused(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    with PredictionStore(StoreConfig(url=url)) as store:
        store.put_state("hydra.store.schema", {"version": 999})
    with PredictionStore(StoreConfig(url=url)) as store, pytest.raises(StoreError, match="schema version 999"):
        store.counts("m")
