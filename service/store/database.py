"""The database behind the store: which one (a URL), its engine, its transactions, and what counts as "down".

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, exc, insert, select, text
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import make_url
from sqlalchemy.sql.dml import Insert

from .errors import StoreError, StoreUnavailable
from .schema import SCHEMA_KEY, SCHEMA_VERSION, metadata, state

__all__ = ["Database", "DatabaseConfig", "default_state_dir", "is_transient", "resolve_url", "short_error"]

log = logging.getLogger("hydra.store")

STORE_FILE = "store.db"
# PostgreSQL: an arbitrary constant naming the advisory lock held while the schema is created
SCHEMA_LOCK = 0x48594452


def default_state_dir() -> Path:
    """``$XDG_STATE_HOME/hydra-serve``, else ``~/.local/state/hydra-serve`` (the XDG base directory for state)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "hydra-serve"


def resolve_url(url: str | None, state_dir: str | os.PathLike[str] | None) -> str:
    """The SQLAlchemy URL of the store: ``url`` with PostgreSQL spelled for psycopg 3, else the SQLite file
    ``store.db`` in ``state_dir`` (default :func:`default_state_dir`)."""
    if url:
        scheme, sep, rest = url.strip().partition("://")
        if scheme.lower() in ("postgres", "postgresql", "postgresql+psycopg"):
            return f"postgresql+psycopg://{rest}"
        if scheme.lower() == "sqlite":
            return url.strip()
        raise StoreError(f"store URL: scheme {scheme!r} is not supported; use postgresql:// or sqlite://")
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


@dataclass(frozen=True)
class DatabaseConfig:
    """How to reach the database and how long to wait on it."""

    url: str  # a SQLAlchemy URL (resolve_url)
    busy_timeout_s: float = 5.0  # wait for a lock (SQLite: the write lock; PostgreSQL: a row or table lock)
    connect_timeout_s: float = 5.0  # PostgreSQL: a server that does not answer is down after this long
    statement_timeout_s: float = 30.0  # PostgreSQL: longest statement (a large read)


class Database:
    """One engine and its transactions; every method is blocking (call it off the event loop)."""

    def __init__(self, config: DatabaseConfig) -> None:
        self.config = config
        self.url = make_url(config.url)
        self.dialect = self.url.get_backend_name()  # "sqlite" or "postgresql"
        if self.dialect not in ("sqlite", "postgresql"):
            raise StoreError(f"store URL: backend {self.dialect!r} is not supported; use postgresql or sqlite")
        self._schema_ok = False
        self._schema_lock = threading.Lock()
        self.engine = self._sqlite_engine() if self.dialect == "sqlite" else self._postgres_engine()

    @property
    def where(self) -> str:
        """The database for logs: the URL without its password."""
        return self.url.render_as_string(hide_password=True)

    def _sqlite_engine(self) -> Engine:
        engine = create_engine(
            self.url,
            connect_args={"timeout": self.config.busy_timeout_s, "check_same_thread": False},
            pool_size=4,
            max_overflow=4,
        )
        busy_ms = int(self.config.busy_timeout_s * 1000)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn: Any, _record: Any) -> None:
            dbapi_conn.isolation_level = None  # no implicit BEGIN: the "begin" listener below emits ours
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=FULL")
            cur.execute(f"PRAGMA busy_timeout={busy_ms}")
            cur.close()

        @event.listens_for(engine, "begin")
        def _begin(conn: Connection) -> None:
            immediate = conn.get_execution_options().get("hydra_write", False)
            conn.exec_driver_sql("BEGIN IMMEDIATE" if immediate else "BEGIN")

        return engine

    def _postgres_engine(self) -> Engine:
        lock_ms, statement_ms = int(self.config.busy_timeout_s * 1000), int(self.config.statement_timeout_s * 1000)
        return create_engine(
            self.url,
            pool_size=4,
            max_overflow=4,
            pool_pre_ping=True,
            pool_timeout=self.config.connect_timeout_s,
            # many rows go through psycopg's executemany (one statement, pipelined), not SQLAlchemy's multi-VALUES
            # statements, which psycopg parses in Python once per 1,000 rows (most of a 10,000-row batch's time)
            use_insertmanyvalues=False,
            connect_args={
                "connect_timeout": max(1, round(self.config.connect_timeout_s)),
                "options": f"-c statement_timeout={statement_ms} -c lock_timeout={lock_ms}",
                "application_name": "hydra-serve",
            },
        )

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
        if self.dialect == "postgresql":
            conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:name))"), {"name": name})

    def insert(self, table: Any) -> Insert:
        """``INSERT ... ON CONFLICT DO NOTHING`` in this database's dialect: a row whose key exists is skipped."""
        if self.dialect == "postgresql":
            return pg_dialect.insert(table).on_conflict_do_nothing()
        return sqlite_dialect.insert(table).on_conflict_do_nothing()

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
        if self.dialect == "postgresql":
            self._maintain(f"ANALYZE {', '.join(tables)}")

    def checkpoint(self) -> None:
        """SQLite: copy the write-ahead log into the database and truncate it (best effort). SQLite's own
        checkpoints after each 1,000 pages restart the log only when no reader is inside it, which a busy server
        rarely allows, so the log file grows; this one waits for the readers (new ones go on unimpeded) and
        empties it. The writer calls it after each retention pass. PostgreSQL: nothing to do."""
        if self.dialect == "sqlite":
            self._maintain("PRAGMA wal_checkpoint(TRUNCATE)")

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
            path = self.url.database
            if self.dialect == "sqlite" and path and path != ":memory:":
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            with self.engine.connect() as conn:
                conn.execution_options(hydra_write=True)
                with conn.begin():
                    if self.dialect == "postgresql":
                        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({SCHEMA_LOCK})")
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
