"""The HTTP server of ``python -m service``: uvicorn on the fastest event loop and HTTP parser installed, and a
shutdown that refuses new connections instead of resetting them.

Event loop and parser (``HYDRA_LOOP``, ``HYDRA_HTTP``; :func:`http_stack`): ``auto`` runs uvloop (libuv) and
httptools (llhttp) when they import, else asyncio and h11 (pure Python); the start-up log says which. Both are
pinned dependencies (``pyproject.toml``), so ``auto`` means uvloop and httptools wherever they have wheels. Measured
on a 2-core AMD EPYC with the text-fast artifact, 8 clients on keep-alive connections: 139 and 155 req/s with
uvloop and httptools against 124 and 129 with asyncio and h11, in two interleaved runs; with asyncio and h11 the
server reached 0.78 (8 clients) and 0.81 (32 clients) of the raw model's throughput.

Shutdown (:class:`Server`, Linux). uvicorn's own shutdown closes the listening socket at once. A connection whose
three-way handshake the kernel had completed but that the server had not yet taken from the accept queue is then
reset: its client connected, sent its request and reads "connection reset by peer", neither an answer nor a
refusal (1 SIGTERM in 3 under 16 clients without keep-alive did so). uvicorn then also closes every accepted
connection that has not sent a full request head yet, and closing a socket with unread bytes sends a reset too.
Here the stop goes in three steps instead:

1. **Stop accepting** (at the signal): a classic BPF filter on the listening socket drops every segment with SYN
   and without ACK (:func:`refuse_new_connections`), i.e. every new connection attempt. The client hears nothing and
   sends its SYN again after the retransmission timeout (1 s on Linux); by then the socket is closed and the kernel
   answers that SYN with a reset: ``connect()`` fails with ECONNREFUSED, as it should. Handshakes already under way
   complete (their final ACK passes the filter) and join the accept queue. The filter needs no privilege (a
   classic socket filter, which any process may attach to its own sockets).
2. **Drain the accept queue**: the server goes on accepting until the queue is empty (``TCP_INFO`` of a listening
   socket gives its length: :func:`accept_queue_length`) and every connection has sent a full request head, at
   most :data:`DRAIN_LIMIT_S` (a client that connected and sends nothing is closed as uvicorn would). The requests
   of these connections are answered in full: the models still run. Measured with ``benchmarks/sigterm_test.py
   --repeat 20`` (16 clients, tiny ViT, 2 cores): the drain took 0 to 53 ms, :data:`DRAIN_SETTLE_S` included.
3. **uvicorn's shutdown**: the listening socket is closed (nothing is left in its queue to reset), requests in
   flight finish (``--graceful-timeout``), then the app's lifespan answers what is queued and stops the workers.

Where socket filters are not available (not Linux, or refused), step 1 is skipped and step 2 still empties the
queue before the socket closes: that narrows the window in which a connection can be reset, but cannot close it.
Keep-alive connections idle when the server stops are closed as before; HTTP/1.1 clients retry a request sent on
a connection the server closed at that moment (RFC 9112, 9.3.1).

``benchmarks/sigterm_test.py`` checks all of it from the client side. Its target, 0 resets and 0 lost over 20
SIGTERMs under 16 clients without keep-alive, held: 86,361 requests, 5,890 refused, none reset or lost
(``benchmarks/results/sigterm_tiny-vit.json``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import importlib
import logging
import os
import signal
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

import uvicorn
from uvicorn.server import HANDLED_SIGNALS

from service.fleet import mark_ready

__all__ = [
    "DRAIN_LIMIT_S",
    "DRAIN_SETTLE_S",
    "Server",
    "accept_queue_length",
    "http_stack",
    "refuse_new_connections",
]

log = logging.getLogger("hydra.service")

# longest the accept queue is drained on shutdown; a connection that sends no request head by then is closed
DRAIN_LIMIT_S = 2.0
# the drain lasts at least this long after new connections are refused: handshakes under way at that moment (SYN
# answered, ACK not yet back: a round trip, well under a millisecond on loopback and in a cluster) join the queue
DRAIN_SETTLE_S = 0.05

# <asm-generic/socket.h>; Python's socket module does not export it
SO_ATTACH_FILTER = 26
# Classic BPF run on each segment that reaches the listening socket; a TCP socket's filter sees the segment from
# its TCP header on (offset 13: the flags byte). Each instruction is (code, jump if true, jump if false, k).
_DROP_NEW_CONNECTIONS = (
    (0x30, 0, 0, 13),  # BPF_LD | BPF_B | BPF_ABS: A = flags
    (0x54, 0, 0, 0x12),  # BPF_ALU | BPF_AND | BPF_K: A &= SYN | ACK
    (0x15, 0, 1, 0x02),  # BPF_JMP | BPF_JEQ | BPF_K: A == SYN (a new connection)? next : skip one
    (0x06, 0, 0, 0),  # BPF_RET | BPF_K: drop it
    (0x06, 0, 0, 0xFFFFFFFF),  # BPF_RET | BPF_K: keep the whole segment (handshakes' ACKs, data)
)
# struct tcp_info: 8 one-byte fields, then u32 rto, ato, snd_mss, rcv_mss, unacked; on a listening socket
# `unacked` is the accept queue's length (net/ipv4/tcp.c, tcp_get_info)
_TCPI_UNACKED_OFFSET = 24


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def http_stack(loop: str, http: str, importable: Callable[[str], bool] = _importable) -> tuple[str, str]:
    """The event loop and HTTP parser uvicorn runs: ``auto`` is uvloop / httptools when they import, else asyncio /
    h11; a named one is kept. Raises ``ValueError`` naming a module that was asked for and does not import."""
    if loop == "auto":
        loop = "uvloop" if importable("uvloop") else "asyncio"
    if http == "auto":
        http = "httptools" if importable("httptools") else "h11"
    for module, setting in ((loop, "HYDRA_LOOP"), (http, "HYDRA_HTTP")):
        if module in ("uvloop", "httptools") and not importable(module):
            raise ValueError(f"{setting}={module}, but {module} does not import; install it or set {setting}=auto")
    return loop, http


@contextlib.contextmanager
def _dup(sock: Any) -> Iterator[socket.socket]:
    """A ``socket.socket`` on a duplicate of ``sock``'s descriptor (asyncio's and uvloop's listening sockets are
    wrappers of their own); options set through it apply to the socket itself. Closing it leaves ``sock`` open."""
    dup = socket.socket(fileno=os.dup(sock.fileno()))
    try:
        yield dup
    finally:
        dup.close()


def refuse_new_connections(sock: Any) -> bool:
    """Make the kernel drop every new connection attempt (SYN) to listening ``sock``, while the handshakes under way
    finish and the accept queue stays as it is. True when done; False where socket filters are not available.

    Clients retransmit a dropped SYN and get ECONNREFUSED once the socket is closed (module docstring).
    """
    if not sys.platform.startswith("linux"):
        return False
    code = b"".join(struct.pack("HBBI", *ins) for ins in _DROP_NEW_CONNECTIONS)
    buf = ctypes.create_string_buffer(code, len(code))
    prog = struct.pack("HP", len(_DROP_NEW_CONNECTIONS), ctypes.addressof(buf))  # struct sock_fprog
    try:
        with _dup(sock) as s:
            s.setsockopt(socket.SOL_SOCKET, SO_ATTACH_FILTER, prog)  # the kernel copies the program
    except OSError as e:
        log.warning("cannot stop new connections before closing the listening socket (%s): some may be reset", e)
        return False
    return True


def accept_queue_length(sock: Any) -> int | None:
    """Connections in the kernel's accept queue of listening ``sock`` (handshake done, not yet accepted); None where
    the kernel does not tell (not Linux)."""
    if not sys.platform.startswith("linux") or not hasattr(socket, "TCP_INFO"):
        return None
    try:
        with _dup(sock) as s:
            info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCPI_UNACKED_OFFSET + 8)
    except OSError:
        return None
    return struct.unpack_from("I", info, _TCPI_UNACKED_OFFSET)[0]


class Server(uvicorn.Server):
    """uvicorn's server, with the shutdown of the module docstring, and a stop by signal that ends ``serve()``
    normally instead of re-raising the signal afterwards (uvicorn's default, which makes the exit status say
    "killed by SIGTERM")."""

    stop_signal: int | None = None
    refusing_since: float | None = None

    def listening_sockets(self) -> list[Any]:
        """The listening sockets (none before start-up or once closed)."""
        return [s for server in getattr(self, "servers", ()) for s in (server.sockets or ())]

    def stop_accepting(self) -> None:
        """Step 1: new connection attempts are dropped (refused once the socket closes). Idempotent."""
        if self.refusing_since is not None:
            return
        sockets = self.listening_sockets()
        if sockets:
            self.refusing_since = time.monotonic()
            if all([refuse_new_connections(s) for s in sockets]):
                log.info("not accepting new connections: they are refused once the queued ones are served")

    async def drain_accept_queue(self) -> None:
        """Step 2: accept until the accept queue is empty and every connection sent its request head."""
        sockets = self.listening_sockets()
        if not sockets:
            return
        limit = min(DRAIN_LIMIT_S, self.config.timeout_graceful_shutdown or DRAIN_LIMIT_S)
        t0 = time.monotonic()
        settled = (self.refusing_since or t0) + DRAIN_SETTLE_S
        while True:
            queued = sum(accept_queue_length(s) or 0 for s in sockets)
            waiting = _without_request(self.server_state.connections)
            now = time.monotonic()
            if (not queued and not waiting and now >= settled) or self.force_exit:  # force: a second SIGINT
                break
            if now - t0 >= limit:
                log.warning(
                    "stopping with %d connection(s) queued and %d without a request after %.1f s",
                    queued,
                    waiting,
                    limit,
                )
                break
            await asyncio.sleep(0.005)
        log.info("accept queue drained in %.0f ms", (time.monotonic() - t0) * 1000)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.stop_accepting()
        await self.drain_accept_queue()
        await super().shutdown(sockets=sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.stop_signal is None:
            self.stop_signal = sig
            log.info("received %s: graceful shutdown", signal.Signals(sig).name)
            mark_ready(False)  # a worker of several: the others' /readyz says the server is not whole any more
            self.stop_accepting()  # at once: uvicorn's loop notices the signal up to 0.1 s later
        super().handle_exit(sig, frame)


def _without_request(connections: Iterable[Any]) -> int:
    """Connections that have not sent a full request head yet: uvicorn's HTTP protocols start a request cycle once
    the head is parsed, and close a connection without one at shutdown."""
    return sum(1 for c in connections if getattr(c, "cycle", True) is None)
