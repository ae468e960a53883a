"""The databases the store runs on, one class each: everything that differs between SQLite and PostgreSQL.

:class:`StoreBackend` is the interface :class:`~.database.Database` drives: the URL schemes a backend answers to,
its engine (pool, timeouts, how transactions begin), and the few statements whose SQL is its own (a named lock
for the transaction, ``INSERT ... ON CONFLICT DO NOTHING``, statistics after a bulk fill, a log checkpoint, the
lock around schema creation). A new database is one more subclass and one more entry in :data:`BACKENDS`; the
store's tests run against each backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine, create_engine, event, text
from sqlalchemy.dialects import postgresql as pg_dialect
from sqlalchemy.dialects import sqlite as sqlite_dialect
from sqlalchemy.engine import URL
from sqlalchemy.sql.dml import Insert

__all__ = ["BACKENDS", "DatabaseConfig", "PostgresBackend", "SqliteBackend", "StoreBackend", "backend_for_scheme"]


@dataclass(frozen=True)
class DatabaseConfig:
    """How to reach the database and how long to wait on it."""

    url: str  # a SQLAlchemy URL (resolve_url)
    busy_timeout_s: float = 5.0  # wait for a lock (SQLite: the write lock; PostgreSQL: a row or table lock)
    connect_timeout_s: float = 5.0  # PostgreSQL: a server that does not answer is down after this long
    statement_timeout_s: float = 30.0  # PostgreSQL: longest statement (a large read)


# PostgreSQL: an arbitrary constant naming the advisory lock held while the schema is created
SCHEMA_LOCK = 0x48594452


class StoreBackend:
    """One database's side of the store (see the module docstring); stateless."""

    name: str  # SQLAlchemy's backend name
    schemes: tuple[str, ...]  # the URL schemes a user may write

    def url(self, scheme: str, rest: str) -> str:
        """The SQLAlchemy URL of a user's ``scheme://rest``."""
        return f"{scheme}://{rest}"

    def engine(self, url: URL, config: DatabaseConfig) -> Engine:
        raise NotImplementedError

    def prepare(self, url: URL) -> None:
        """Before the schema is created (a folder to make)."""

    def serialize(self, conn: Connection, name: str) -> None:
        """Hold a lock named ``name`` until ``conn``'s transaction ends (transactions naming it run one at a time)."""

    def insert(self, table: Any) -> Insert:
        """``INSERT ... ON CONFLICT DO NOTHING``: a row whose key exists is skipped."""
        raise NotImplementedError

    def schema_lock(self, conn: Connection) -> None:
        """Inside the schema's creation transaction: keep replicas that start together from racing."""

    def after_fill(self, tables: tuple[str, ...]) -> str | None:
        """A maintenance statement after a bulk fill of ``tables`` (None: nothing to do)."""
        return None

    def checkpoint(self) -> str | None:
        """A maintenance statement that truncates the write-ahead log (None: nothing to do)."""
        return None


class SqliteBackend(StoreBackend):
    """SQLite: WAL mode, ``synchronous=FULL``, ``busy_timeout`` as the wait for the one write lock; writing
    transactions begin ``IMMEDIATE`` (the module docstring of :mod:`.database` says why)."""

    name = "sqlite"
    schemes = ("sqlite",)

    def engine(self, url: URL, config: DatabaseConfig) -> Engine:
        engine = create_engine(
            url,
            connect_args={"timeout": config.busy_timeout_s, "check_same_thread": False},
            pool_size=4,
            max_overflow=4,
        )
        busy_ms = int(config.busy_timeout_s * 1000)

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

    def prepare(self, url: URL) -> None:
        path = url.database
        if path and path != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)

    def insert(self, table: Any) -> Insert:
        return sqlite_dialect.insert(table).on_conflict_do_nothing()

    def checkpoint(self) -> str | None:
        # SQLite's own checkpoints restart the log only when no reader is inside it, which a busy server rarely
        # allows; this one waits for the readers and empties it
        return "PRAGMA wal_checkpoint(TRUNCATE)"


class PostgresBackend(StoreBackend):
    """PostgreSQL through psycopg 3: a small pool, connections checked before use, connect, lock and statement
    timeouts; advisory locks for the named locks and the schema's creation."""

    name = "postgresql"
    schemes = ("postgres", "postgresql", "postgresql+psycopg")

    def url(self, scheme: str, rest: str) -> str:
        return f"postgresql+psycopg://{rest}"

    def engine(self, url: URL, config: DatabaseConfig) -> Engine:
        lock_ms, statement_ms = int(config.busy_timeout_s * 1000), int(config.statement_timeout_s * 1000)
        return create_engine(
            url,
            pool_size=4,
            max_overflow=4,
            pool_pre_ping=True,
            pool_timeout=config.connect_timeout_s,
            # many rows go through psycopg's executemany (one statement, pipelined), not SQLAlchemy's multi-VALUES
            # statements, which psycopg parses in Python once per 1,000 rows (most of a 10,000-row batch's time)
            use_insertmanyvalues=False,
            connect_args={
                "connect_timeout": max(1, round(config.connect_timeout_s)),
                "options": f"-c statement_timeout={statement_ms} -c lock_timeout={lock_ms}",
                "application_name": "hydra-serve",
            },
        )

    def serialize(self, conn: Connection, name: str) -> None:
        conn.execute(text("SELECT pg_advisory_xact_lock(hashtext(:name))"), {"name": name})

    def insert(self, table: Any) -> Insert:
        return pg_dialect.insert(table).on_conflict_do_nothing()

    def schema_lock(self, conn: Connection) -> None:
        conn.exec_driver_sql(f"SELECT pg_advisory_xact_lock({SCHEMA_LOCK})")

    def after_fill(self, tables: tuple[str, ...]) -> str | None:
        # without fresh statistics a table just filled looks empty to the planner (a nested loop over every pair)
        return f"ANALYZE {', '.join(tables)}"


BACKENDS: dict[str, StoreBackend] = {b.name: b for b in (SqliteBackend(), PostgresBackend())}


def backend_for_scheme(scheme: str) -> StoreBackend | None:
    """The backend a user's URL scheme names (None: none does)."""
    return next((b for b in BACKENDS.values() if scheme.lower() in b.schemes), None)
