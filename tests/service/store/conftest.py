"""Fixtures of the store's tests: every test runs on SQLite and on a real PostgreSQL server.

The PostgreSQL server is Debian's (the ``postgresql`` package, which ``.ci/run`` installs): this session runs its
``initdb`` and ``pg_ctl`` into a temporary folder, listening on a free loopback port and a socket in that folder,
and stops it at the end. PostgreSQL refuses to run as root, so under root the server runs as the ``postgres``
system user (``runuser``). Without the binaries the PostgreSQL half skips, saying so. Each test gets a fresh
database. ``fsync=off``: the tests kill processes, never the machine, and a killed process loses nothing that
reached the kernel.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from service.store import PredictionStore, StoreConfig

BACKENDS = ("sqlite", "postgresql")
# timings for tests: a database that is down is noticed within seconds (a loaded machine's fsync can hold SQLite's
# write lock for a good part of a second, so lock waits get 2 s)
FAST = {"busy_timeout_s": 2.0, "connect_timeout_s": 1.0, "flush_ms": 10.0}


def _pg_bin() -> Path | None:
    """The folder of Debian's PostgreSQL binaries (initdb, pg_ctl), newest version first, else from PATH."""
    for folder in sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name), reverse=True):
        if (Path(folder) / "initdb").is_file() and (Path(folder) / "pg_ctl").is_file():
            return Path(folder)
    initdb = shutil.which("initdb")
    return Path(initdb).resolve().parent if initdb and shutil.which("pg_ctl") else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PostgresServer:
    """A throwaway PostgreSQL cluster: ``start``, ``stop`` (``immediate`` = killed), fresh databases, URLs."""

    def __init__(self, bin_dir: Path, root: Path, user: str | None) -> None:
        self.bin, self.root, self.user = bin_dir, root, user
        self.data, self.log = root / "data", root / "server.log"
        self.port = _free_port()

    def _run(self, *args: str) -> None:
        cmd = [str(self.bin / args[0]), *args[1:]]
        if self.user is not None:
            cmd = ["runuser", "-u", self.user, "--", *cmd]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            log = self.log.read_text()[-2000:] if self.log.is_file() else ""
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}\n{log}")

    def init(self) -> None:
        self._run("initdb", "-D", str(self.data), "-U", "hydra", "-A", "trust", "-E", "UTF8", "--no-sync")

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.root} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c full_page_writes=off -c shared_buffers=16MB -c max_connections=60"
        )
        self._run("pg_ctl", "-D", str(self.data), "-l", str(self.log), "-o", options, "-w", "-t", "60", "start")

    def stop(self, mode: str = "fast") -> None:
        self._run("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "60", "stop")

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://hydra@127.0.0.1:{self.port}/{database}"

    def create_database(self) -> str:
        import psycopg

        name = f"t_{uuid.uuid4().hex[:12]}"
        with psycopg.connect(f"host=127.0.0.1 port={self.port} user=hydra dbname=postgres", autocommit=True) as c:
            c.execute(f'CREATE DATABASE "{name}"')
        return name


@pytest.fixture(scope="session")
def postgres() -> Iterator[PostgresServer]:
    """A PostgreSQL server for the session (skips when Debian's binaries are absent)."""
    bin_dir = _pg_bin()
    if bin_dir is None:
        pytest.skip("PostgreSQL binaries (initdb, pg_ctl) not found: apt-get install -y postgresql")
    user = None
    if os.geteuid() == 0:  # initdb and postgres refuse root
        try:
            pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no 'postgres' user to run PostgreSQL as")
        user = "postgres"
    root = Path(tempfile.mkdtemp(prefix="hydra-pg-"))  # under /tmp: the postgres user must reach it
    if user is not None:
        shutil.chown(root, user, user)
    server = PostgresServer(bin_dir, root, user)
    server.init()
    server.start()
    try:
        yield server
    finally:
        with contextlib.suppress(Exception):
            server.stop("immediate")  # a throwaway cluster: no checkpoint
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def store_url(backend: str, request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty database of ``backend``: a SQLite file, or a new database on the session's server."""
    if backend == "sqlite":
        return f"sqlite:///{tmp_path / 'state' / 'store.db'}"
    server: PostgresServer = request.getfixturevalue("postgres")
    return server.url(server.create_database())


@pytest.fixture
def make_store(store_url: str) -> Iterator[Callable[..., PredictionStore]]:
    """``make_store(**config)`` -> a store on this test's database with test timings; closed at the end."""
    made: list[PredictionStore] = []

    def make(**overrides: Any) -> PredictionStore:
        config = replace(StoreConfig(url=store_url, **FAST), **overrides)
        store = PredictionStore(config)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close(timeout=1.0)
