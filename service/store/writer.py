"""The prediction writer: records queued by the event loop, written in batches by one background thread.

**Policy.** :meth:`Writer.submit` never blocks and never raises: it appends the records to a bounded in-memory
queue (``capacity`` records, counting the batch being written) under a lock that the thread holds only to take a
batch (and feedback only to look up its answers' records), and returns.
Records that do not fit are dropped and counted (``dropped["full"]``), so a slow or dead database costs the
predictions nothing: they are answered as always, and only their records are lost.

The thread writes a batch (at most ``batch_rows`` records, one transaction) once ``flush_rows`` records wait, or
``flush_s`` after the oldest of them arrived, or at once when asked to (:meth:`Writer.flush`, closing). When the
database is unreachable or busy (:func:`~.database.is_transient`), the batch goes back to the head of the queue and
the thread retries after a back-off (``backoff_s``, doubling to ``backoff_max_s``); meanwhile the queue fills and
new records are dropped. When the database refuses the batch itself (a bad value), the records are written one by
one and only those it refuses are dropped (``dropped["error"]``).

Every ``retention_interval_s`` seconds, while the database works, the thread applies retention (:mod:`.writes`),
then empties SQLite's write-ahead log (:meth:`~.database.Database.checkpoint`), so that the files stay within
retention too.

**Shutdown.** :meth:`Writer.close` stops taking records (later ones are dropped as ``closed``), writes everything
queued, retrying until ``close_timeout_s`` if the database is down, then drops (and counts, and logs) what is left.

**Not yet written.** :meth:`Writer.pending` finds queued records by answer id: feedback for an answer whose record
still waits writes that record itself, in its own transaction (a key stored twice keeps one row), so that a label
sent right after its answer finds its prediction. :meth:`Writer.flush` waits until every record submitted before
the call has been written or dropped.
"""

from __future__ import annotations

import itertools
import logging
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from service.store.database import Database, is_transient, short_error
from service.store.records import PredictionRecord, StoreStats
from service.store.writes import Retention, apply_retention, insert_predictions

__all__ = ["Writer", "WriterConfig"]

log = logging.getLogger("hydra.store")

DROP_LOG_EVERY_S = 60.0  # at most one warning about dropped records per minute
ANALYZE_FIRST = 1_000  # PostgreSQL: statistics refreshed at 1,000 rows written, then at every doubling


@dataclass(frozen=True)
class WriterConfig:
    """The writer's limits and timings (module docstring)."""

    capacity: int = 10_000  # most records queued (including the batch being written)
    flush_rows: int = 256  # write once this many wait
    flush_s: float = 0.2  # ... or once the oldest waited this long
    batch_rows: int = 1_000  # most records per transaction
    retention: Retention | None = None
    retention_interval_s: float = 60.0
    backoff_s: float = 0.1  # first wait after a failed write
    backoff_max_s: float = 5.0
    close_timeout_s: float = 10.0  # how long close() keeps retrying a database that is down


class Writer:
    """One background thread writing :class:`PredictionRecord` batches to ``db`` (module docstring)."""

    def __init__(self, db: Database, config: WriterConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._db = db
        self._config = config
        self._clock = clock
        self._cond = threading.Condition()
        self._queue: deque[PredictionRecord] = deque()
        self._inflight = 0  # records taken for the batch being written
        self._batch: list[PredictionRecord] = []  # that batch
        self._oldest_at = math.inf  # when the oldest queued record arrived
        self._accepted = 0  # records ever queued
        self._settled = 0  # of those, written or dropped
        self._flush_wanted = False
        self._closing = False
        self._close_deadline = math.inf
        self._retry_at = -math.inf
        self._failures = 0
        self._next_retention = clock() + config.retention_interval_s
        self._last_drop_log = -math.inf
        self._analyze_at = ANALYZE_FIRST  # rows written when the planner's statistics are next refreshed
        self._stats = StoreStats()
        self._thread = threading.Thread(target=self._run, name="hydra-store-writer", daemon=True)
        self._thread.start()

    # --------------------------------------------------------------------------------------- the caller's side

    def submit(self, records: Sequence[PredictionRecord]) -> int:
        """Queue ``records`` without blocking; the number queued (the rest were dropped and counted)."""
        n = len(records)
        if n == 0:
            return 0
        with self._cond:
            self._stats.submitted += n
            if self._closing:
                self._stats.dropped["closed"] += n
                return 0
            take = max(0, min(n, self._config.capacity - len(self._queue) - self._inflight))
            if take < n:
                self._stats.dropped["full"] += n - take
                self._log_drops()
            if take:
                if not self._queue:
                    self._oldest_at = self._clock()
                    self._cond.notify()  # the thread may be waiting with no deadline
                self._queue.extend(records[:take] if take < n else records)
                self._accepted += take
                if len(self._queue) >= self._config.flush_rows:
                    self._cond.notify()
            return take

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record queued before this call is written or dropped; False if ``timeout`` passed."""
        with self._cond:
            target = self._accepted
            if self._settled >= target:
                return True
            self._flush_wanted = True
            self._cond.notify_all()
            return self._cond.wait_for(lambda: self._settled >= target, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Stop taking records, write what is queued (retrying for up to ``timeout``, default ``close_timeout_s``,
        while the database is down), drop the rest, and stop the thread."""
        wait = self._config.close_timeout_s if timeout is None else timeout
        with self._cond:
            if not self._closing:
                self._closing = True
                self._close_deadline = self._clock() + wait
            self._cond.notify_all()
        self._thread.join(wait + 5.0)  # a transaction in progress finishes first (its own timeouts bound it)

    def pending(self, model: str, ids: set[str]) -> list[PredictionRecord]:
        """The records of ``model`` with an answer id in ``ids`` that are queued or being written (not yet known
        to be stored): feedback writes them itself, so that a label sent right after its answer finds it."""
        with self._cond:
            return [r for r in itertools.chain(self._batch, self._queue) if r.id in ids and r.model == model]

    def stats(self) -> StoreStats:
        """A copy of the counters, ``queued`` as of now."""
        with self._cond:
            out = replace(self._stats, dropped=dict(self._stats.dropped))
            out.queued = len(self._queue) + self._inflight
            return out

    def _log_drops(self) -> None:
        now = self._clock()
        if now - self._last_drop_log >= DROP_LOG_EVERY_S:
            self._last_drop_log = now
            log.warning(
                "prediction store: queue full (%d records), dropping records (%s so far); the database (%s) is "
                "slow or down: %s",
                self._config.capacity,
                self._stats.dropped,
                self._db.where,
                self._stats.last_error or "no error yet",
            )

    # -------------------------------------------------------------------------------------- the thread's side

    def _run(self) -> None:
        self._connect()
        while True:
            with self._cond:
                batch = self._next_batch()
            if batch is None:
                return
            if batch:
                self._write(batch)
            if self._failures == 0 and not self._closing:
                self._retain_if_due()

    def _connect(self) -> None:
        """Create the schema at start-up, so that a database that is down is reported at once."""
        try:
            self._db.ensure_schema()
            with self._cond:
                self._stats.up = True
            log.info("prediction store: %s", self._db.where)
        except Exception as e:
            self._failed(e, [])

    def _next_batch(self) -> list[PredictionRecord] | None:
        """(Lock held.) Wait for the next batch; [] when retention is due, None when closed and done."""
        c = self._config
        while True:
            now = self._clock()
            if self._closing and not self._queue:
                return None
            if self._closing and now >= self._close_deadline:
                self._drop_queued_at_close()
                return None
            urgent = self._flush_wanted or self._closing or len(self._queue) >= c.flush_rows
            due_at = now if urgent else self._oldest_at + c.flush_s
            due_at = max(due_at, self._retry_at)
            if self._queue and now >= due_at:
                batch = [self._queue.popleft() for _ in range(min(c.batch_rows, len(self._queue)))]
                self._inflight, self._batch = len(batch), batch
                self._oldest_at = now if self._queue else math.inf
                self._flush_wanted = self._flush_wanted and bool(self._queue)
                return batch
            if not self._queue and now >= self._next_retention and not self._closing:
                return []
            wake = min(due_at if self._queue else math.inf, self._next_retention, self._close_deadline)
            self._cond.wait(max(0.0, min(wake - now, 3600.0)))

    def _write(self, batch: list[PredictionRecord]) -> None:
        try:
            insert_predictions(self._db, batch)
        except Exception as e:
            if is_transient(e) or isinstance(e, OSError):
                self._failed(e, batch)
                return
            log.error("prediction store: a batch was refused (%s); writing its records one by one", short_error(e))
            self._write_each(batch)
            return
        self._settle(written=len(batch))
        if self._stats.written >= self._analyze_at:
            self._analyze_at = 2 * self._stats.written
            self._db.analyze("predictions", "feedback")

    def _write_each(self, batch: list[PredictionRecord]) -> None:
        """Write the records of a refused batch one by one, dropping (and counting) those the database refuses."""
        refused = 0
        for i, record in enumerate(batch):
            try:
                insert_predictions(self._db, [record])
            except Exception as e:
                if is_transient(e) or isinstance(e, OSError):
                    self._failed(e, batch[i:])
                    break
                log.debug("prediction store: record %s/%d refused: %s", record.id, record.index, short_error(e))
                refused += 1
                self._settle(refused=1)
                continue
            self._settle(written=1)
        if refused:
            log.error("prediction store: %d of %d records refused and dropped", refused, len(batch))

    def _settle(self, written: int = 0, refused: int = 0) -> None:
        """Records of the batch in flight written, or refused by the database (dropped): count, wake flush()."""
        with self._cond:
            self._inflight -= written + refused
            if self._inflight == 0:
                self._batch = []
            self._settled += written + refused
            self._stats.written += written
            self._stats.dropped["error"] += refused
            if written:
                if self._failures:
                    log.info("prediction store: the database is back (%s)", self._db.where)
                self._failures, self._retry_at = 0, -math.inf
                self._stats.up, self._stats.last_error = True, None
            self._cond.notify_all()

    def _failed(self, error: BaseException, batch: list[PredictionRecord]) -> None:
        """The database is down or busy: put ``batch`` (in flight) back at the head of the queue and back off."""
        self._db.lost()
        with self._cond:
            self._queue.extendleft(reversed(batch))
            self._inflight, self._batch = self._inflight - len(batch), []
            if batch:
                self._oldest_at = min(self._oldest_at, self._clock())
            wait = min(self._config.backoff_max_s, self._config.backoff_s * 2**self._failures)
            self._retry_at = self._clock() + wait
            if self._failures == 0:
                log.warning(
                    "prediction store: the database (%s) is unavailable (%s); records are queued (%d) and retried",
                    self._db.where,
                    short_error(error),
                    len(self._queue),
                )
            self._failures += 1
            self._stats.up, self._stats.last_error = False, short_error(error)

    def _drop_queued_at_close(self) -> None:
        """(Lock held.) The database stayed down past the close deadline: drop what is queued, loudly."""
        n = len(self._queue)
        self._queue.clear()
        self._stats.dropped["error"] += n
        self._settled += n
        self._cond.notify_all()
        log.error(
            "prediction store: %d prediction records lost at shutdown: the database (%s) stayed unavailable (%s)",
            n,
            self._db.where,
            self._stats.last_error,
        )

    def _retain_if_due(self) -> None:
        retention = self._config.retention
        if retention is None or self._clock() < self._next_retention:
            return
        self._next_retention = self._clock() + self._config.retention_interval_s
        try:
            deleted = apply_retention(self._db, retention, time.time())
        except Exception as e:
            interval = self._config.retention_interval_s
            log.warning("prediction store: retention failed (%s); retried in %.0f s", short_error(e), interval)
            return
        if deleted:
            with self._cond:
                self._stats.retention_deleted += deleted
            log.info("prediction store: retention deleted %d predictions (and their feedback)", deleted)
        self._db.analyze("predictions", "feedback")
        self._db.checkpoint()
