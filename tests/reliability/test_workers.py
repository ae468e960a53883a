"""Several workers on one port (``HYDRA_WORKERS``, service/workers.py), through the real ``python -m service``: both
workers answer, ``/metrics`` is one view of both, ``/readyz`` is 503 while a worker is missing, a worker killed with
SIGKILL under load loses only its requests in flight and is replaced while the other answers, and SIGTERM stops them
all with status 0. A bad ``HYDRA_WORKERS`` refuses start-up in one line."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import pytest
from pydantic import ValidationError

from benchmarks import harness
from service.settings import Settings, settings_errors
from service.workers import resolve_workers
from tests.fixtures.tiny_artifact import make_tiny_artifact
from tests.service.helpers import b64, noise_images, png

ROOT = Path(__file__).resolve().parents[2]


def workers_of(pid: int) -> list[int]:
    """The worker processes of supervisor ``pid`` (its children that run the server)."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if int(stat[1]) == pid and b"spawn_main" in cmd:
            out.append(int(entry.name))
    return sorted(out)


def cpu_ticks(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(stat[11]) + int(stat[12])


def status(port: int, path: str) -> int:
    try:
        return asyncio.run(harness.request(port, "GET", path, timeout=5.0))[0]
    except (OSError, asyncio.TimeoutError, ValueError):  # noqa: UP041
        return 0


async def load(port: int, body: bytes, seconds: float, clients: int = 6) -> dict[str, int]:
    """``clients`` clients, a new connection per request, for ``seconds``: answers by outcome."""
    tally = {"ok": 0, "error": 0, "reset": 0}
    t_end = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < t_end:
            try:
                st, _, _ = await harness.request(port, "POST", "/predict", body, timeout=10.0)
                tally["ok" if st == 200 else "error"] += 1
            except (OSError, asyncio.IncompleteReadError, ValueError):
                tally["reset"] += 1
                await asyncio.sleep(0.01)

    await asyncio.gather(*(client() for _ in range(clients)))
    return tally


def metric_sum(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + "{"))


def test_two_workers_answer_as_one_server_survive_a_kill_and_stop_cleanly(tmp_path):
    art = make_tiny_artifact(tmp_path / "vit", "vit", name="tiny-w", guarantees={"risks": [0.5], "risk": 0.5})
    port = harness.free_port()
    extra = {"HYDRA_WORKERS": "2", "HYDRA_STATE_DIR": str(tmp_path / "state"), "HYDRA_LOG_LEVEL": "info"}
    proc = harness.start_server(art, port, extra, log_file=tmp_path / "server.log", new_session=True)
    try:
        harness.wait_ready(port, proc, timeout=120)
        pids = workers_of(proc.pid)
        assert len(pids) == 2, pids
        body = json.dumps({"image": b64(png(noise_images(1, seed=3)[0]))}).encode()
        before = {p: cpu_ticks(p) for p in pids}
        tally = asyncio.run(load(port, body, 3.0))
        assert tally["ok"] > 50 and tally["error"] == tally["reset"] == 0, tally
        assert all(cpu_ticks(p) > before[p] for p in pids)  # both workers answered
        text = asyncio.run(harness.request(port, "GET", "/metrics"))[2].decode()
        # one view of both: every answer counted once (plus each worker's warm-up input)
        assert metric_sum(text, "hydra_predictions_total") == tally["ok"] + 2
        assert "hydra_ready 1.0" in text
        # SIGKILL one worker under load: only its requests in flight are lost, the other keeps answering
        victim = pids[0]
        loop_result: dict[str, int] = {}

        async def kill_during_load() -> None:
            task = asyncio.create_task(load(port, body, 4.0))
            await asyncio.sleep(1.0)
            os.kill(victim, signal.SIGKILL)
            loop_result.update(await task)

        asyncio.run(kill_during_load())
        assert loop_result["ok"] > 50 and loop_result["error"] == 0, loop_result
        assert loop_result["reset"] <= 6, loop_result  # at most the clients' requests in flight on it
        # a replacement starts; /readyz says 503 until it is ready, then 200
        t0, seen_503 = time.monotonic(), False
        while time.monotonic() - t0 < 90:
            code = status(port, "/readyz")
            seen_503 |= code == 503
            new = workers_of(proc.pid)
            if code == 200 and len(new) == 2 and victim not in new:
                break
            time.sleep(0.2)
        assert len(new) == 2 and victim not in new and status(port, "/readyz") == 200
        assert seen_503 or time.monotonic() - t0 < 0.5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        assert workers_of(proc.pid) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    text = (tmp_path / "server.log").read_text()
    assert f"worker {victim} died" in text and "starting a replacement" in text


def test_workers_setting_is_checked_and_auto_is_one_on_cpu():
    assert Settings(workers="auto").workers == "auto" and Settings(workers="3").workers == 3
    for bad in ("0", "many", "2.5", "-1", "65"):
        with pytest.raises(ValidationError) as e:
            Settings(workers=bad)
        (line,) = settings_errors(e.value)
        assert line == f"HYDRA_WORKERS must be auto or an integer from 1 to 64; got {bad!r}"
    assert resolve_workers("auto", "cpu") == 1 and resolve_workers(4, "cpu") == 4


async def _slow_client(port: int, seconds: float) -> None:
    """A client that sends a request's head and then its body a few bytes at a time (a slow uplink, or a slowloris
    attack): the worker that took it holds the connection, and must not stall on it."""
    reader, writer = await asyncio.open_connection(harness.HOST, port)
    writer.write(
        b"POST /predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: 100000\r\n\r\n"
    )
    t_end = time.monotonic() + seconds
    try:
        while time.monotonic() < t_end:
            writer.write(b'{"image"   ')
            await writer.drain()
            await asyncio.sleep(0.2)
    except OSError:
        pass
    finally:
        writer.close()


async def _too_large(port: int, limit: int) -> tuple[int, bytes]:
    """A body of 8 times the limit, streamed: the answer (413) comes without the server reading it all."""
    reader, writer = await asyncio.open_connection(harness.HOST, port)
    size = 8 * limit
    head = f"POST /predict HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    writer.write(head.encode())
    try:
        for _ in range(size // 4096):
            writer.write(b" " * 4096)
            await writer.drain()
    except OSError:  # the server answered and closed before the body was sent
        pass
    got = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    status = int(got.split()[1])
    length = int(next(ln.split(b":")[1] for ln in got.split(b"\r\n") if ln.lower().startswith(b"content-length")))
    body = await asyncio.wait_for(reader.readexactly(length), 10)
    writer.close()
    return status, body


def test_slow_clients_and_an_oversized_body_stall_no_worker(tmp_path):
    """With two workers, 16 slow clients (spread over both by the kernel) and a body over the limit do not keep
    either worker from answering the others: every normal request during them is answered."""
    art = make_tiny_artifact(tmp_path / "vit", "vit", name="tiny-s")
    port, limit = harness.free_port(), 64 * 1024
    extra = {"HYDRA_WORKERS": "2", "HYDRA_STORE": "off", "HYDRA_MAX_BODY_BYTES": str(limit)}
    proc = harness.start_server(art, port, extra, log_file=tmp_path / "server.log")
    try:
        harness.wait_ready(port, proc, timeout=120)
        assert len(workers_of(proc.pid)) == 2
        body = json.dumps({"image": b64(png(noise_images(1, seed=4)[0]))}).encode()

        async def scenario() -> tuple[dict[str, int], tuple[int, bytes]]:
            slow = [asyncio.create_task(_slow_client(port, 4.0)) for _ in range(16)]
            await asyncio.sleep(0.3)
            big = asyncio.create_task(_too_large(port, limit))
            tally = await load(port, body, 3.0)
            out = await big
            await asyncio.gather(*slow)
            return tally, out

        tally, (code, answer) = asyncio.run(scenario())
        assert tally["ok"] > 30 and tally["error"] == tally["reset"] == 0, tally
        assert code == 413 and json.loads(answer)["error"]["code"] == "payload_too_large"
    finally:
        assert harness.stop_server(proc) == 0
