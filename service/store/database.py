"""The database behind the store: which one (a URL), its engine, its transactions, and what counts as "down".

The databases' own settings and SQL live in :mod:`.backends`, one class each; this module drives them.

**Which database.** ``HYDRA_STORE_URL`` names it: ``postgresql://user:password@host:5432/db`` (several replicas
share one) or ``sqlite:///path``; unset, the store is a SQLite file ``store.db`` in ``HYDRA_STATE_DIR`` (default
``$XDG_STATE_HOME/hydra-serve``, else ``~/.local/state/hydra-serve``, the XDG base directory for state). PostgreSQL
URLs are driven by psycopg 3 (``postgresql+psycopg``) whatever their spelling.

**SQLite.** WAL mode, so readers never block the writer or each other; ``synchronous=FULL``, so a commit is on
disk when it returns (with ``NORMAL`` a WAL commit may be lost on power failure, SQLite's "WAL mode" documentation,
section "Performance considerations"); ``busy_timeout`` as the wait for the one write lock. Transactions that
write begin ``IMMEDIATE``: they take the write lock first, so one that read before it writes cannot fail midway with
"database is locked" when another connection wrote meanwhile (a deferred transaction cannot upgrade its read
snapshot). Python's own transaction handling is switched off so that these ``BEGIN`` statements are the only ones.

**PostgreSQL.** A small pool (the writer thread, feedback and reads), connections checked before use
(``pool_pre_ping``: a restarted server costs one failed check, not an error), a connect timeout, a lock timeout
and a statement timeout, so that a dead or stuck server is noticed in seconds, never waited on forever.

**Down.** :func:`is_transient` decides whether an error means the database is unreachable or busy (retry later;
the writer keeps the rows) or that it refused the statement (retrying would fail again).

**Schema.** :meth:`Database.ensure_schema` creates missing tables (``CREATE TABLE IF NOT EXISTS``); on PostgreSQL
under an advisory lock, so replicas starting together do not race. It records :data:`~.schema.SCHEMA_VERSION`
and refuses a store written by another version.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, exc, insert, select
from sqlalchemy.engine import make_url
from sqlalchemy.sql.dml import Insert

from service.store.dialects import BACKENDS, DatabaseConfig, backend_for_scheme
from service.store.schema import SCHEMA_KEY, SCHEMA_VERSION, metadata, state
from service.store.store_errors import StoreError, StoreUnavailable

__all__ = ["Database", "DatabaseConfig", "default_state_dir", "is_transient", "resolve_url", "short_error"]

log = logging.getLogger("hydra.store")

STORE_FILE = "store.db"


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/hydra-serve``, else ``~/.local/state/hydra-serve`` (the XDG base directory for state)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "hydra-serve"


def resolve_url(url: str | None, state_dir: str | os.PathLike[str] | None) -> str:
    """The SQLAlchemy URL of the store: ``url`` with PostgreSQL spelled for psycopg 3, else the SQLite file
    ``store.db`` in ``state_dir`` (default :func:`default_state_dir`)."""
    if url:
        scheme, sep, rest = url.strip().partition("://")
        backend = backend_for_scheme(scheme)
        if backend is None:
            raise StoreError(f"store URL: scheme {scheme!r} is not supported; use postgresql:// or sqlite://")
        return backend.url(scheme, rest)
    folder = Path(state_dir) if state_dir else default_state_dir()
    return f"sqlite:///{(folder / STORE_FILE).absolute()}"


def is_transient(error: BaseException) -> bool:
    """True when ``error`` says the database is unreachable, restarting or busy (retry later), False when it
    refused the statement (its data or the schema): retrying would fail the same way."""
    if isinstance(error, StoreUnavailable):
        return True
    if isinstance(error, exc.DBAPIError) and error.connection_invalidated:
        return True
    return isinstance(error, (exc.OperationalError, exc.InterfaceError, exc.DisconnectionError, exc.TimeoutError))


def short_error(error: BaseException) -> str:
    """The first line of an error, for a log line (SQLAlchemy appends the statement and its parameters)."""
    text = str(getattr(error, "orig", None) or error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


class Database:
    """One engine and its transactions; every method is blocking (call it off the event loop)."""

    def __init__(self, config: DatabaseConfig) -> None:
        self.config = config
        self.url = make_url(config.url)
        self.dialect = self.url.get_backend_name()  # "sqlite" or "postgresql"
        if self.dialect not in BACKENDS:
            raise StoreError(f"store URL: backend {self.dialect!r} is not supported; use postgresql or sqlite")
        self.backend = BACKENDS[self.dialect]
        self._schema_ok = False
        self._schema_lock = threading.Lock()
        self.engine = self.backend.engine(self.url, config)

    @property
    def where(self) -> str:
        """The database for logs: the URL without its password."""
        return self.url.render_as_string(hide_password=True)

    # ------------------------------------------------------------------------------------------ transactions

    @contextlib.contextmanager
    def write(self) -> Iterator[Connection]:
        """A write transaction, committed on leaving (rolled back on an error); the schema exists inside it."""
        self.ensure_schema()
        with self.engine.connect() as conn:
            conn.execution_options(hydra_write=True)
            with conn.begin():
                yield conn

    @contextlib.contextmanager
    def read(self) -> Iterator[Connection]:
        """A read transaction (one consistent snapshot on both backends)."""
        self.ensure_schema()
        with self.engine.connect() as conn, conn.begin():
            yield conn

    def serialize(self, conn: Connection, name: str) -> None:
        """Hold a lock named ``name`` until ``conn``'s transaction ends, so that transactions naming it run one at a
        time: on PostgreSQL an advisory lock; on SQLite every write transaction holds the one write lock already."""
        self.backend.serialize(conn, name)

    def insert(self, table: Any) -> Insert:
        """``INSERT ... ON CONFLICT DO NOTHING`` in this database's dialect: a row whose key exists is skipped."""
        return self.backend.insert(table)

    @contextlib.contextmanager
    def guarded(self, what: str) -> Iterator[None]:
        """Database errors inside become the store's: :class:`StoreUnavailable` when the database is down or busy
        (nothing was committed), :class:`StoreError` when it refused the statement; the details go to the log."""
        try:
            yield
        except StoreError:
            raise
        except (exc.SQLAlchemyError, OSError) as e:
            if isinstance(e, OSError) or is_transient(e):
                self.lost()
                log.warning("%s: the store's database %s is unavailable: %s", what, self.where, short_error(e))
                raise StoreUnavailable(f"{what}: the prediction store is unavailable; retry shortly") from e
            log.error("%s: the store's database %s refused it: %s", what, self.where, short_error(e))
            raise StoreError(f"{what}: the prediction store failed; see the server log") from e

    def analyze(self, *tables: str) -> None:
        """PostgreSQL: refresh the planner's statistics of ``tables`` (best effort). Without them a table just
        filled looks empty, and a join over it runs as a nested loop over every pair of rows (seconds for 10,000
        rows); autovacuum catches up only after its own delay. SQLite's planner prefers the indexes without them."""
        sql = self.backend.after_fill(tables)
        if sql is not None:
            self._maintain(sql)

    def checkpoint(self) -> None:
        """SQLite: copy the write-ahead log into the database and truncate it (best effort). SQLite's own
        checkpoints after each 1,000 pages restart the log only when no reader is inside it, which a busy server
        rarely allows, so the log file grows; this one waits for the readers (new ones go on unimpeded) and
        empties it. The writer calls it after each retention pass. PostgreSQL: nothing to do."""
        sql = self.backend.checkpoint()
        if sql is not None:
            self._maintain(sql)

    def _maintain(self, sql: str) -> None:
        """Run one maintenance statement outside a transaction, best effort: a failure is logged, not raised."""
        try:
            with self.engine.connect() as conn:
                conn.execution_options(isolation_level="AUTOCOMMIT").exec_driver_sql(sql)
        except exc.SQLAlchemyError as e:
            log.debug("%s failed: %s", sql, short_error(e))

    def lost(self) -> None:
        """The database failed: check the schema again on the next use (it may be a new, empty one)."""
        self._schema_ok = False

    def dispose(self) -> None:
        self.engine.dispose()

    # ------------------------------------------------------------------------------------------------ schema

    def ensure_schema(self) -> None:
        """Create missing tables and check the schema version, once per connection to a working database."""
        if self._schema_ok:
            return
        with self._schema_lock:
            if self._schema_ok:
                return
            self.backend.prepare(self.url)
            with self.engine.connect() as conn:
                conn.execution_options(hydra_write=True)
                with conn.begin():
                    self.backend.schema_lock(conn)
                    metadata.create_all(conn, checkfirst=True)
                    self._check_version(conn)
            self._schema_ok = True

    def _check_version(self, conn: Connection) -> None:
        row = conn.execute(select(state.c.value).where(state.c.key == SCHEMA_KEY)).first()
        if row is None:
            value = {"version": SCHEMA_VERSION}
            conn.execute(insert(state).values(key=SCHEMA_KEY, value=value, version=1, updated=time.time()))
            return
        found = row[0].get("version") if isinstance(row[0], dict) else None
        if found != SCHEMA_VERSION:
            log.error(
                "prediction store %s: schema version %s, this server writes %s", self.where, found, SCHEMA_VERSION
            )
            raise StoreError(
                f"the prediction store has schema version {found}, this server writes version {SCHEMA_VERSION}; "
                "point HYDRA_STORE_URL at another database or migrate this one"
            )
