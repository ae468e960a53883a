"""The prediction store: one object over the database, the writer thread, feedback, reads and shared state.

Who calls what:

* the inference path, on the event loop: :meth:`PredictionStore.record` (never blocks, never raises; records that
  cannot be queued are dropped and counted in :meth:`PredictionStore.stats`);
* the feedback route, in a worker thread: :meth:`PredictionStore.add_feedback` (blocking; committed when it
  returns; :class:`~.errors.StoreUnavailable` when the database is down);
* the live statistics, in a worker thread: :meth:`PredictionStore.labelled`, :meth:`PredictionStore.served`,
  :meth:`PredictionStore.counts`, and the shared state (:meth:`PredictionStore.get_state`,
  :meth:`PredictionStore.put_state`, :meth:`PredictionStore.update_state`);
* the lifecycle, at shutdown: :meth:`PredictionStore.close` (or ``await`` :meth:`PredictionStore.aclose`), which
  writes everything queued.

Every method but :meth:`~PredictionStore.record`, :meth:`~PredictionStore.stats` and :meth:`~PredictionStore.aclose`
blocks on the database: call them off the event loop (``anyio.to_thread.run_sync``).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from service.store import feedback as feedback_ops
from service.store import reads, state
from service.store.database import Database, DatabaseConfig, resolve_url
from service.store.records import Counts, FeedbackItem, FeedbackStatus, PredictionRecord, Rows, StateEntry, StoreStats
from service.store.writer import Writer, WriterConfig
from service.store.writes import Retention

__all__ = ["PredictionStore", "StoreConfig", "open_store"]

DAY_S = 86_400.0
# the StoreConfig fields set by the HYDRA_STORE_<FIELD> setting of the same name (Settings.store_<field>)
_STORE_SETTINGS = ("queue", "flush_rows", "flush_ms", "retention_days", "max_rows", "probs")


@dataclass(frozen=True)
class StoreConfig:
    """Everything the store needs, from the settings (:meth:`from_settings`) or given directly (tests)."""

    url: str  # postgresql://..., sqlite:///... (database.resolve_url)
    queue: int = 10_000  # HYDRA_STORE_QUEUE
    flush_rows: int = 256  # HYDRA_STORE_FLUSH_ROWS
    flush_ms: float = 200.0  # HYDRA_STORE_FLUSH_MS
    retention_days: float = 30.0  # HYDRA_STORE_RETENTION_DAYS
    max_rows: int = 1_000_000  # HYDRA_STORE_MAX_ROWS
    probs: bool = True  # HYDRA_STORE_PROBS: whether callers should keep the probabilities (records_from_items)
    retention_interval_s: float = 60.0  # how often the writer applies retention
    busy_timeout_s: float = 5.0  # SQLite lock wait; PostgreSQL statement timeout
    connect_timeout_s: float = 5.0
    close_timeout_s: float = 10.0  # how long close() retries a database that is down
    max_label_chars: int = 10_000  # longest label name feedback takes (HYDRA_MAX_TEXT_CHARS)

    @classmethod
    def from_settings(cls, s: Any) -> StoreConfig | None:
        """The store's configuration from ``HYDRA_*`` settings (a :class:`service.settings.Settings`, which sits above
        the store: it reads the backends' URL schemes); None when ``HYDRA_STORE=off``."""
        if not s.store:
            return None
        url = s.store_url.get_secret_value() if s.store_url is not None else None
        tuning = {name: getattr(s, f"store_{name}") for name in _STORE_SETTINGS}
        return cls(url=resolve_url(url, s.state_dir), max_label_chars=s.max_text_chars, **tuning)


class PredictionStore:
    """What the server answered, and the labels that came back for it (module docstring)."""

    def __init__(self, config: StoreConfig, clock: Callable[[], float] = time.time) -> None:
        self.config = config
        self._clock = clock
        url = resolve_url(config.url, None)  # postgresql:// -> postgresql+psycopg://
        self._db = Database(DatabaseConfig(url, config.busy_timeout_s, config.connect_timeout_s))
        retention = Retention(max_age_s=config.retention_days * DAY_S, max_rows=config.max_rows)
        self._writer = Writer(
            self._db,
            WriterConfig(
                capacity=config.queue,
                flush_rows=config.flush_rows,
                flush_s=config.flush_ms / 1000.0,
                retention=retention,
                retention_interval_s=config.retention_interval_s,
                close_timeout_s=config.close_timeout_s,
            ),
        )
        self._closed = False

    @property
    def backend(self) -> str:
        """``sqlite`` or ``postgresql``."""
        return self._db.dialect

    @property
    def where(self) -> str:
        """The database, for logs (no password)."""
        return self._db.where

    # ------------------------------------------------------------------------------------------- predictions

    def record(self, records: Sequence[PredictionRecord]) -> int:
        """Queue served predictions for writing: never blocks, never raises; the number queued (the others were
        dropped and counted in :meth:`stats`)."""
        return self._writer.submit(records)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every record queued so far is written or dropped; False if ``timeout`` passed first."""
        return self._writer.flush(timeout)

    def stats(self) -> StoreStats:
        """The writer's counters (records submitted, written, dropped by reason, queued; the database up)."""
        return self._writer.stats()

    # ---------------------------------------------------------------------------------------------- feedback

    def add_feedback(self, model: str, labels: Sequence[str], items: Sequence[FeedbackItem]) -> list[FeedbackStatus]:
        """Store true labels for ``model``'s predictions (``labels``: the model's own): one status per item, in order:
        ``accepted``, ``duplicate``, ``unknown_id`` or ``invalid_label`` (:mod:`.feedback`). Committed when it
        returns; raises :class:`~.errors.StoreUnavailable` (nothing committed) when the database is down."""
        return feedback_ops.add_feedback(
            self._db,
            model,
            labels,
            items,
            now=self._clock(),
            max_label_chars=self.config.max_label_chars,
            pending=lambda ids: self._writer.pending(model, ids),
        )

    # ------------------------------------------------------------------------------------------------- reads

    def labelled(
        self, model: str, version: str | None = None, *, last: int | None = None, since: float | None = None
    ) -> Rows:
        """``model``'s labelled predictions joined with their labels, oldest label first: the ``last`` latest
        labels, or those since ``since`` (Unix seconds); of one ``version`` or all."""
        return reads.read_rows(self._db, model, version, labelled=True, since=since, last=last)

    def served(
        self, model: str, version: str | None = None, *, last: int | None = None, since: float | None = None
    ) -> Rows:
        """``model``'s predictions, labelled or not, oldest first: the ``last`` latest, or those answered since
        ``since``; of one ``version`` or all."""
        return reads.read_rows(self._db, model, version, labelled=False, since=since, last=last)

    def confidence_sums(self, model: str, version: str | None = None) -> tuple[int, float, float]:
        """``(n, sum p, sum p (1 - p))`` of the top-label probabilities of ``model``'s stored predictions (of one
        ``version`` or all): the label-free accuracy estimate over every stored answer, summed in the database."""
        return reads.confidence_sums(self._db, model, version)

    def counts(self, model: str, version: str | None = None) -> Counts:
        """How many predictions of ``model`` (and ``version``) are stored, labelled, and labelled foreign."""
        return reads.count_rows(self._db, model, version)

    # ------------------------------------------------------------------------------------------ shared state

    def get_state(self, key: str) -> StateEntry | None:
        """The shared value under ``key`` with its version, or None."""
        return state.get_state(self._db, key)

    def put_state(self, key: str, value: Any, expected_version: int | None = None) -> StateEntry:
        """Store a JSON ``value`` under ``key``; with ``expected_version`` only if the stored version is that
        (0: only if absent), else :class:`~.errors.StateConflict`."""
        return state.put_state(self._db, key, value, now=self._clock(), expected_version=expected_version)

    def update_state(self, key: str, change: Callable[[Any], Any], retries: int = 16) -> StateEntry:
        """Store ``change(current value or None)`` under ``key`` by compare-and-set, retrying when another replica
        wrote first; the entry written."""
        return state.update_state(self._db, key, change, now=self._clock, retries=retries)

    # ------------------------------------------------------------------------------------------------- close

    def close(self, timeout: float | None = None) -> None:
        """Write everything queued (retrying a database that is down for up to ``timeout``, default
        ``close_timeout_s``), stop the writer and close the connections. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._writer.close(timeout)
        self._db.dispose()

    async def aclose(self, timeout: float | None = None) -> None:
        """:meth:`close` in a worker thread, for the lifespan's shutdown."""
        await asyncio.to_thread(self.close, timeout)

    def __enter__(self) -> PredictionStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_store(settings: Any) -> PredictionStore | None:
    """The store the settings ask for (None with ``HYDRA_STORE=off``). It does not wait for the database: one that
    is down is retried in the background, and the server starts and serves meanwhile."""
    config = StoreConfig.from_settings(settings)
    return None if config is None else PredictionStore(config)
