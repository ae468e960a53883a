"""Against a real ``python -m service`` on loopback (uvicorn, sockets): 100 MB bodies, declared and chunked, are
refused early without the server reading or holding them; the API key never reaches the log; SIGTERM with requests
in flight lets them finish, refuses new connections and exits 0. The last test stops the server."""

from __future__ import annotations

import asyncio
import json
import re
import select
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.harness import free_port, request, rss_mb, start_server, wait_ready
from tests.service.helpers import b64, png

KEY = "rel-7Hq2-secret-token-9x"
AUTH = {"Authorization": f"Bearer {KEY}"}
LIMIT = 16 * 1024 * 1024  # HYDRA_MAX_BODY_BYTES default
HUNDRED_MB = 100 * 1024 * 1024


@dataclass
class Live:
    proc: subprocess.Popen
    port: int
    log: Path


@pytest.fixture(scope="module")
def live(artifacts: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    log = tmp_path_factory.mktemp("live") / "server.log"
    port = free_port()
    env = {
        "HYDRA_API_KEY": KEY,
        "HYDRA_LOG_LEVEL": "debug",
        "HYDRA_MAX_BATCH": "2",
        "HYDRA_MAX_WAIT_MS": "0",
        "RELIABILITY_DELAY_S": "0.6",
    }
    proc = start_server(artifacts["vit"], port, env, log_file=log, module="tests.reliability.slow_service")
    try:
        wait_ready(port, proc, timeout=120)
        yield Live(proc, port, log)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def read_response(sock: socket.socket, timeout: float = 20.0) -> tuple[int, dict]:
    """Status and JSON body of one HTTP/1.1 response read from a raw socket."""
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a full response head: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    found = re.search(rb"(?i)content-length:\s*(\d+)", head)
    assert found, head
    length = int(found.group(1))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed in the middle of the response body"
        body += chunk
    return int(head.split()[1]), json.loads(body[:length])


def head(extra: str) -> bytes:
    return (
        f"POST /predict HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
        f"Content-Type: application/json\r\n{extra}\r\n"
    ).encode()


def assert_still_serving(port: int) -> None:
    status, _, _ = asyncio.run(request(port, "GET", "/readyz"))
    assert status == 200
    body = json.dumps({"image": b64(png(7))}).encode()
    status, _, answer = asyncio.run(request(port, "POST", "/predict", body, headers=AUTH))
    assert status == 200, answer


def test_declared_100mb_body_is_refused_before_it_is_read(live: Live) -> None:
    before = rss_mb(live.proc.pid)["rss"]
    t0 = time.monotonic()
    with socket.create_connection(("127.0.0.1", live.port)) as s:
        s.sendall(head(f"Content-Length: {HUNDRED_MB}\r\n"))
        s.sendall(b'{"text": "' + b"a" * 65536)  # the start of a 100 MB body; the rest never comes
        status, body = read_response(s)
    assert status == 413 and body["error"]["code"] == "payload_too_large", body
    assert str(HUNDRED_MB) in body["error"]["message"] and "HYDRA_MAX_BODY_BYTES" in body["error"]["message"]
    assert time.monotonic() - t0 < 10
    assert rss_mb(live.proc.pid)["rss"] - before < 32  # nothing near 100 MB was allocated
    assert_still_serving(live.port)


def test_chunked_100mb_body_is_cut_off_at_the_limit(live: Live) -> None:
    before = rss_mb(live.proc.pid)["rss"]
    chunk = b"a" * (1 << 20)
    sent = 0
    with socket.create_connection(("127.0.0.1", live.port)) as s:
        s.sendall(head("Transfer-Encoding: chunked\r\n") + b'a\r\n{"text": "\r\n')  # one 10-byte chunk
        s.settimeout(10)
        answered = False
        while sent < HUNDRED_MB:
            if select.select([s], [], [], 0)[0]:  # the server answered: stop sending
                answered = True
                break
            try:
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
            except (BrokenPipeError, ConnectionResetError, TimeoutError):
                break  # the server closed the connection after answering
            sent += len(chunk)
        status, body = read_response(s)
    assert status == 413 and body["error"]["code"] == "payload_too_large", body
    assert "HYDRA_MAX_BODY_BYTES" in body["error"]["message"]
    # the server stopped taking the body a little after the limit (socket buffers hold a few MiB more)
    assert sent < LIMIT + 16 * (1 << 20), (sent, answered)
    assert rss_mb(live.proc.pid)["rss"] - before < 64
    assert_still_serving(live.port)


def test_api_key_is_required_and_never_logged(live: Live) -> None:
    image = json.dumps({"image": b64(png(9))}).encode()
    for headers, want in (
        ({}, 401),
        ({"Authorization": f"Bearer {KEY}x"}, 401),
        ({"Authorization": KEY}, 401),
        ({"Authorization": f"Bearer {KEY[:-1]}"}, 401),
        (AUTH, 200),
    ):
        status, _, answer = asyncio.run(request(live.port, "POST", "/predict", image, headers=headers))
        assert status == want, answer
        assert KEY not in answer.decode()
    # the key as the value of an unknown field or of a bad image: not echoed in the error
    for body in ({"text": "x", "api_key": KEY}, {"image": KEY}, {"images": [b64(png(1)), KEY]}):
        status, _, answer = asyncio.run(request(live.port, "POST", "/predict", json.dumps(body).encode(), headers=AUTH))
        assert 400 <= status < 500 and KEY[:8] not in answer.decode(), answer
    status, _, metrics = asyncio.run(request(live.port, "GET", "/metrics"))
    assert status == 200 and KEY not in metrics.decode()
    text = live.log.read_text(errors="replace")
    assert "POST /predict" in text  # the access log is on (debug): requests are logged, their headers are not
    assert KEY not in text and KEY[:8] not in text


def test_sigterm_lets_in_flight_requests_finish_refuses_new_ones_and_exits_0(live: Live) -> None:
    """The last test of the module: it stops the server."""
    white = json.dumps({"image": b64(png(255))}).encode()  # each batch of these sleeps 0.6 s in the server
    n = 6

    async def scenario() -> tuple[list[int], int, int]:
        in_flight = [
            asyncio.create_task(request(live.port, "POST", "/predict", white, timeout=60, headers=AUTH))
            for _ in range(n)
        ]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until all n are inside the server (the /metrics request is one more)
            _, _, m = await request(live.port, "GET", "/metrics")
            if float(re.search(rb"\nhydra_requests_in_flight (\S+)", m).group(1)) >= n + 1:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the requests never were in flight together")
        live.proc.send_signal(15)
        refused = reset = 0
        t_end = time.monotonic() + 10
        while time.monotonic() < t_end:  # new connections: refused once the listening socket is closed
            try:
                await request(live.port, "GET", "/healthz", timeout=5)
            except ConnectionRefusedError:
                refused += 1
                break
            except OSError:
                reset += 1  # accepted by the kernel just before the listening socket closed, never served
            await asyncio.sleep(0.05)
        statuses = [(await t)[0] for t in in_flight]
        return statuses, refused, reset

    statuses, refused, _ = asyncio.run(scenario())
    assert statuses == [200] * n  # every in-flight request finished
    assert refused == 1
    assert live.proc.wait(60) == 0  # a graceful stop exits 0
    text = live.log.read_text(errors="replace")
    m = re.search(r"\((\d+) requests received, (\d+) answered\)", text)
    assert m and m.group(1) == m.group(2), text[-2000:]  # nothing the server received went unanswered
    assert "received SIGTERM: graceful shutdown" in text
    assert KEY not in text
