"""service/entrypoints/http_server.py: which event loop and HTTP parser run, and a shutdown that answers the
connections the kernel had queued and refuses new ones, checked on real sockets (Linux: the mechanism needs its socket
filters)."""

from __future__ import annotations

import asyncio
import socket
import sys
import threading
import time
from typing import Any

import pytest
import uvicorn
from pydantic import ValidationError
from uvicorn._compat import asyncio_run

from benchmarks.harness import free_port
from service import settings as settings_module
from service.entrypoints.http_server import Server, accept_queue_length, http_stack, refuse_new_connections
from service.settings import Settings

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="socket filters and TCP_INFO: Linux")


@pytest.mark.parametrize(
    ("loop", "http", "installed", "want"),
    [
        ("auto", "auto", {"uvloop", "httptools"}, ("uvloop", "httptools")),
        ("auto", "auto", set(), ("asyncio", "h11")),  # no wheels for this platform: the pure-Python pair
        ("auto", "auto", {"httptools"}, ("asyncio", "httptools")),
        ("asyncio", "h11", {"uvloop", "httptools"}, ("asyncio", "h11")),  # named: kept
    ],
)
def test_http_stack_prefers_the_c_modules_when_they_import(loop, http, installed, want):
    assert http_stack(loop, http, importable=installed.__contains__) == want


def test_a_named_module_that_does_not_import_is_refused(monkeypatch):
    with pytest.raises(ValueError, match="HYDRA_LOOP=uvloop, but uvloop does not import"):
        http_stack("uvloop", "auto", importable=lambda m: False)
    monkeypatch.setattr(settings_module, "_installed", lambda m: False)
    with pytest.raises(ValidationError, match="httptools is not installed"):
        Settings(http="httptools")
    assert Settings(http="auto", loop="auto").http == "auto"  # auto falls back instead


def test_this_environment_runs_uvloop_and_httptools():
    """Both are pinned runtime dependencies: ``auto`` must find them here (and in the image)."""
    assert http_stack("auto", "auto") == ("uvloop", "httptools")


def _connect(port: int, timeout: float) -> socket.socket:
    s = socket.socket()
    s.settimeout(timeout)
    s.connect(("127.0.0.1", port))
    return s


@linux_only
def test_refused_not_reset_and_the_queue_kept():
    """A connection queued before the filter is accepted and answered; one attempted after it does not connect, and
    is refused (not reset) once the socket closes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    queued = _connect(port, 5)
    queued.sendall(b"ping")
    assert accept_queue_length(listener) == 1
    assert refuse_new_connections(listener)
    outcome: dict[str, Any] = {}

    def late() -> None:
        t0 = time.monotonic()
        try:
            _connect(port, 10).close()
            outcome["kind"] = "connected"
        except OSError as e:
            outcome["kind"] = type(e).__name__
        outcome["after_s"] = time.monotonic() - t0

    t = threading.Thread(target=late)
    t.start()
    time.sleep(0.3)
    assert accept_queue_length(listener) == 1  # the late SYN was dropped: nothing joined the queue
    conn, _ = listener.accept()
    assert accept_queue_length(listener) == 0
    assert conn.recv(16) == b"ping"
    conn.sendall(b"pong")
    assert queued.recv(16) == b"pong"
    listener.close()
    t.join(15)
    # the SYN is sent again after Linux's initial retransmission timeout (1 s) and answered by a reset: refused
    assert outcome["kind"] == "ConnectionRefusedError" and outcome["after_s"] >= 0.3, outcome
    conn.close()
    queued.close()


async def _hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"5")]})
    await send({"type": "http.response.body", "body": b"hello"})


def _get(port: int, results: list[str]) -> None:
    """One request on a fresh connection (no keep-alive); appends how it ended."""
    try:
        with _connect(port, 15) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            data = b""
            while chunk := s.recv(4096):
                data += chunk
        results.append("answered" if data.startswith(b"HTTP/1.1 200") and data.endswith(b"hello") else "broken")
    except ConnectionRefusedError:
        results.append("refused")
    except OSError as e:  # ECONNRESET, or a timeout
        results.append(type(e).__name__)


def _stop_with_a_full_queue(server_class: type[uvicorn.Server], loop: str, http: str, n: int = 12) -> tuple[list, list]:
    """Hold the event loop while ``n`` clients connect and send their requests, so that all of them wait in the
    kernel's accept queue when the server is told to stop (as by SIGTERM); one more client comes right after.
    Returns how the ``n`` and the late one ended."""
    port = free_port()
    config = uvicorn.Config(
        _hello,
        host="127.0.0.1",
        port=port,
        loop=loop,
        http=http,
        lifespan="off",
        log_level="warning",
        timeout_graceful_shutdown=5,
    )
    server = server_class(config)
    queued: list[str] = []
    late: list[str] = []
    threads: list[threading.Thread] = []

    async def scenario() -> None:
        while not server.started:
            await asyncio.sleep(0.01)
        listener = server.servers[0].sockets[0]
        threads.extend(threading.Thread(target=_get, args=(port, queued)) for _ in range(n))
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while accept_queue_length(listener) < n and time.monotonic() < deadline:
            time.sleep(0.01)  # holds the event loop: nothing is accepted meanwhile
        assert accept_queue_length(listener) == n
        time.sleep(0.1)  # and the requests are sent
        if isinstance(server, Server):
            server.stop_accepting()  # what its SIGTERM handler does
        server.should_exit = True
        threads.append(threading.Thread(target=_get, args=(port, late)))
        threads[-1].start()

    async def main() -> None:
        await asyncio.gather(server.serve(), scenario())

    asyncio_run(main(), loop_factory=config.get_loop_factory())
    for t in threads:
        t.join(20)
    return queued, late


@linux_only
@pytest.mark.parametrize(("loop", "http"), [("asyncio", "h11"), ("uvloop", "httptools")])
def test_shutdown_answers_every_queued_connection_and_refuses_new_ones(loop, http):
    queued, late = _stop_with_a_full_queue(Server, loop, http)
    assert queued == ["answered"] * 12
    assert late == ["refused"]


@linux_only
def test_uvicorns_own_shutdown_resets_them():
    """The control: the same scenario with uvicorn's shutdown resets the queued connections (the listening socket is
    closed with them in its queue) and the late one. If a uvicorn release stops doing so,
    service/entrypoints/http_server.py's
    drain may go."""
    queued, late = _stop_with_a_full_queue(uvicorn.Server, "uvloop", "httptools")
    assert "ConnectionResetError" in queued + late, (queued, late)
